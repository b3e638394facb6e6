"""A demo tenant, key, model, price and simulator deployment to try the whole flow.

It spans the apps (tenants, deployments, metering), so it lives with the composition root.
"""

from decimal import Decimal
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from deployments import services as deployment_services
from deployments.choices import Task
from deployments.models import CatalogModel, Deployment, EngineProfile, Node
from metering import services as metering_services
from metering.models import Price
from tenants import services as tenant_services
from tenants.models import Tenant

DEMO_MODEL = "demo-chat"
DEMO_IMAGE = "tollgate/engine-sim:latest"


class Command(BaseCommand):
    help = (
        "Create a demo tenant with an API key (printed once), a demo model with a price and a "
        "deployment of it on the simulator engine, so the whole flow can be tried without "
        "downloading a real model. Running it again reuses what exists."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--new-key", action="store_true", help="Issue another demo key.")
        parser.add_argument("--image", default=DEMO_IMAGE, help="Engine image for the demo.")

    @transaction.atomic
    def handle(self, *args: Any, **options: Any) -> None:
        tenant, created = self._tenant()
        model = self._model()
        self._price(model)
        self._deployment(model, options["image"])
        if created or options["new_key"]:
            issued = tenant_services.issue_api_key(None, tenant, name="demo key")
            self.stdout.write(
                f"demo: API key for tenant {tenant.slug!r} (shown only now): {issued.plaintext}"
            )
        else:
            self.stdout.write("demo: the demo tenant exists; use --new-key for another key")
        self.stdout.write(
            f"demo: try model {model.served_name!r} at {settings.TOLLGATE_PUBLIC_URL}/v1"
        )

    def _tenant(self) -> tuple[Tenant, bool]:
        existing = Tenant.objects.filter(slug="demo").first()
        if existing:
            return existing, False
        return tenant_services.create_tenant(None, name="Demo", slug="demo"), True

    def _model(self) -> CatalogModel:
        existing = CatalogModel.objects.filter(served_name=DEMO_MODEL).first()
        if existing:
            return existing
        return deployment_services.create_model(
            None,
            served_name=DEMO_MODEL,
            source="tollgate/demo-sim",
            task=Task.GENERATE,
            params_billions=Decimal("0.6"),
            context_length=8192,
            description="Simulated chat model served by the Tollgate simulator engine.",
        )

    def _price(self, model: CatalogModel) -> None:
        if not Price.objects.filter(model=model).exists():
            metering_services.set_price(
                None,
                model,
                input_per_mtok=Decimal("0.10"),
                cached_input_per_mtok=Decimal("0.05"),
                output_per_mtok=Decimal("0.40"),
                currency=settings.TOLLGATE_DEFAULT_CURRENCY,
            )

    def _deployment(self, model: CatalogModel, image: str) -> None:
        if Deployment.objects.filter(model=model).exists():
            return
        node = Node.objects.filter(name=settings.TOLLGATE_LOCAL_NODE_NAME).first()
        if node is None:
            raise CommandError("No local node: run `manage.py bootstrap` first.")
        deployment_services.create_deployment(
            None,
            name="demo-chat-sim",
            model=model,
            node=node,
            image=image,
            profile=EngineProfile.objects.filter(name="simulator").first(),
            engine_args={"max-model-len": 8192, "max-num-seqs": 8},
            replicas=1,
        )
