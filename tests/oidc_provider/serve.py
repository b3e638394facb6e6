"""Run the test OpenID Connect provider: ``python -m tests.oidc_provider.serve CONFIG.json``.

The JSON names the port, the database file, one confidential client (id, secret, redirect
URI) and the users with their passwords and groups. Serves until terminated.
"""

import json
import os
import sys
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa


class Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class QuietHandler(WSGIRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def main(config_path: str) -> None:
    config = json.loads(open(config_path).read())
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    os.environ["OIDC_PROVIDER_RSA_KEY"] = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    os.environ["OIDC_PROVIDER_DB"] = config["database"]
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.oidc_provider.settings"
    import django

    django.setup()
    from django.contrib.auth.models import Group, User
    from django.core.management import call_command
    from django.core.wsgi import get_wsgi_application
    from oauth2_provider.models import Application

    call_command("migrate", verbosity=0)
    for entry in config["users"]:
        user = User.objects.create_user(entry["username"], entry["email"], entry["password"])
        for name in entry["groups"]:
            user.groups.add(Group.objects.get_or_create(name=name)[0])
    client = config["client"]
    Application.objects.create(
        name="tollgate",
        client_id=client["id"],
        client_secret=client["secret"],
        client_type=Application.CLIENT_CONFIDENTIAL,
        authorization_grant_type=Application.GRANT_AUTHORIZATION_CODE,
        redirect_uris=client["redirect_uri"],
        algorithm=Application.RS256_ALGORITHM,
        skip_authorization=True,
    )
    server = make_server(
        "127.0.0.1",
        config["port"],
        get_wsgi_application(),
        server_class=Server,
        handler_class=QuietHandler,
    )
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1])
