"""Tollgate settings: everything comes from environment variables (see .env.example).

``TOLLGATE_ENV`` selects the profile: ``development`` (default; local PostgreSQL and
Redis, DEBUG on), ``test``, or ``production`` (no defaults for secrets or services;
refuses to start on an unsafe configuration).
"""

import hashlib
from pathlib import Path
from urllib.parse import urlsplit

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from config.env import (
    env_bool,
    env_float,
    env_int,
    env_int_list,
    env_list,
    env_secret,
    env_str,
)

BASE_DIR = Path(__file__).resolve().parent.parent

TOLLGATE_ENV = env_str("TOLLGATE_ENV", "development")
if TOLLGATE_ENV not in {"development", "test", "production"}:
    raise ImproperlyConfigured(
        f"TOLLGATE_ENV={TOLLGATE_ENV!r}: use development, test or production"
    )
PRODUCTION = TOLLGATE_ENV == "production"


def _required_in_production(name: str, dev_default: str, secret: bool = False) -> str:
    value = env_secret(name) if secret else env_str(name)
    if value:
        return value
    if PRODUCTION:
        raise ImproperlyConfigured(f"{name} must be set when TOLLGATE_ENV=production")
    return dev_default


SECRET_KEY = _required_in_production(
    "DJANGO_SECRET_KEY", "dev-insecure-secret-key-do-not-use-in-production", secret=True
)
DEBUG = env_bool("DJANGO_DEBUG", not PRODUCTION)
ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
# The URL users reach (shown in the console; the default trusted origin for forms).
TOLLGATE_PUBLIC_URL = env_str("TOLLGATE_PUBLIC_URL", "http://localhost:8000")
# Forms posted from the public URL's origin pass the CSRF origin check even when a TLS
# front on another port or name stands in front; more origins are listed explicitly.
_public = urlsplit(TOLLGATE_PUBLIC_URL)
CSRF_TRUSTED_ORIGINS = env_list("DJANGO_CSRF_TRUSTED_ORIGINS", []) or [
    f"{_public.scheme}://{_public.netloc}"
]

if PRODUCTION and DEBUG:
    raise ImproperlyConfigured("DJANGO_DEBUG must be off when TOLLGATE_ENV=production")
if PRODUCTION and len(SECRET_KEY) < 50:
    raise ImproperlyConfigured("DJANGO_SECRET_KEY must be at least 50 characters")

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "config.apps.TollgateConfig",  # system checks (config/checks.py)
    "tenants",
    "deployments",
    "metering",
    "gateway",
    "console",
    "batches",  # OpenAI Files and Batch APIs (/v1/files, /v1/batches)
    "alerts",  # console notices and signed webhooks (budget thresholds, engine drift)
    "axes",  # console login throttling (after the apps whose templates it may use)
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "servestatic.middleware.ServeStaticMiddleware",  # static files, async under ASGI
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "console.middleware.PasswordChangeRequiredMiddleware",  # one-time passwords are changed first
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "axes.middleware.AxesMiddleware",  # turns a locked-out login into the lockout page
]

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"
ASGI_APPLICATION = "config.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "console.context.console",
            ],
        },
    },
]

# --- Services -------------------------------------------------------------------------

DATABASE_URL = _required_in_production(
    "DATABASE_URL", "postgres://postgres@127.0.0.1:5432/tollgate", secret=True
)
DATABASES = {
    "default": dj_database_url.parse(DATABASE_URL, conn_max_age=60, conn_health_checks=True)
}
if DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
    raise ImproperlyConfigured("DATABASE_URL must point at PostgreSQL (postgres://…)")
# Test runs create their own database; a name per run lets parallel runs coexist.
DATABASES["default"]["TEST"] = {"NAME": env_str("TOLLGATE_TEST_DATABASE") or None}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = _required_in_production("REDIS_URL", "redis://127.0.0.1:6379/0", secret=True)
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": env_str("TOLLGATE_REDIS_PREFIX", "tollgate"),
    }
}
# Every Redis key Tollgate writes starts with this, so one Redis can serve several stacks
# (and the test suite can work in its own namespace).
TOLLGATE_REDIS_PREFIX = env_str("TOLLGATE_REDIS_PREFIX", "tollgate")

# --- Celery ---------------------------------------------------------------------------

CELERY_BROKER_URL = env_secret("CELERY_BROKER_URL", REDIS_URL)
CELERY_RESULT_BACKEND = None
CELERY_TASK_ACKS_LATE = True  # a task survives a worker killed mid-run; tasks are idempotent
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = "control"
# Messages a worker took but has not acknowledged wait in this hash (kombu redelivers them
# after a crash). The batch runner keeps its own (compose/entrypoint.sh sets it), so that it
# only ever redelivers messages of the queue its Redis user may push to (config/redisacl.py).
_UNACKED = env_str("TOLLGATE_CELERY_UNACKED_KEY", "unacked")
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": 3600,
    "unacked_key": _UNACKED,
    "unacked_index_key": f"{_UNACKED}_index",
    "unacked_mutex_key": f"{_UNACKED}_mutex",
}
CELERY_TIMEZONE = "UTC"
# Celery's Django fixup closes the database connection around every task unless this is set;
# then it closes it only every this many tasks, and config/celery.py treats it between tasks as
# Django does between requests (kept up to CONN_MAX_AGE, dropped when unusable).
CELERY_DB_REUSE_MAX = 1000

# --- Auth and security ----------------------------------------------------------------

PASSWORD_HASHERS = [
    "django.contrib.auth.hashers.Argon2PasswordHasher",
    "django.contrib.auth.hashers.PBKDF2PasswordHasher",
]
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/login/"

# Console login throttling (django-axes): after TOLLGATE_LOGIN_FAILURE_LIMIT failed logins
# for one username from one address, that pair is locked out for the cool-off time.
# Keyed on both so an attacker cannot lock the real admin out from elsewhere.
AUTHENTICATION_BACKENDS = [
    "console.auth.LoginThrottleBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = env_int("TOLLGATE_LOGIN_FAILURE_LIMIT", 5)
AXES_COOLOFF_TIME = env_int("TOLLGATE_LOGIN_LOCKOUT_MINUTES", 15) / 60  # hours
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_TEMPLATE = "console/locked_out.html"
# Only behind reverse proxies (their count set) is X-Forwarded-For believed; else the socket.
AXES_IPWARE_PROXY_COUNT = env_int("TOLLGATE_TRUSTED_PROXY_COUNT", 0) or None
AXES_IPWARE_META_PRECEDENCE_ORDER = (
    ("HTTP_X_FORWARDED_FOR", "REMOTE_ADDR") if AXES_IPWARE_PROXY_COUNT else ("REMOTE_ADDR",)
)
AXES_VERBOSE = False
# POST /api/v1/auth/token/: attempts per client address, and the tokens' default lifetime.
TOLLGATE_TOKEN_LOGIN_RATE = env_str("TOLLGATE_TOKEN_LOGIN_RATE", "20/min")
TOLLGATE_TOKEN_LOGIN_DAYS = env_int("TOLLGATE_TOKEN_LOGIN_DAYS", 30)

# --- Single sign-on (OpenID Connect, authorization code + PKCE; tenants/sso.py) ---------------

# On when an issuer and a client id are set; the provider's endpoints come from its discovery
# document (<issuer>/.well-known/openid-configuration), read at the first sign-in.
TOLLGATE_OIDC_ISSUER = env_str("TOLLGATE_OIDC_ISSUER", "").rstrip("/")
OIDC_RP_CLIENT_ID = env_str("TOLLGATE_OIDC_CLIENT_ID", "")
OIDC_RP_CLIENT_SECRET = env_secret("TOLLGATE_OIDC_CLIENT_SECRET")
OIDC_RP_SCOPES = env_str("TOLLGATE_OIDC_SCOPES") or "openid email profile groups"
OIDC_RP_SIGN_ALGO = env_str("TOLLGATE_OIDC_SIGN_ALGO", "RS256")
OIDC_USE_PKCE = True
OIDC_PKCE_CODE_CHALLENGE_METHOD = "S256"
OIDC_TIMEOUT = env_float("TOLLGATE_OIDC_TIMEOUT", 10.0)
OIDC_VERIFY_SSL = env_bool("TOLLGATE_OIDC_VERIFY_TLS", True)
OIDC_AUTHENTICATION_CALLBACK_URL = "oidc_authentication_callback"
LOGIN_REDIRECT_URL_FAILURE = "/login/"
TOLLGATE_SSO_ENABLED = bool(TOLLGATE_OIDC_ISSUER and OIDC_RP_CLIENT_ID)
TOLLGATE_OIDC_USERNAME_CLAIM = env_str("TOLLGATE_OIDC_USERNAME_CLAIM") or "preferred_username"
TOLLGATE_OIDC_GROUPS_CLAIM = env_str("TOLLGATE_OIDC_GROUPS_CLAIM") or "groups"
# Group → role: platform admins; "group=tenant-slug" pairs (a bare name: the same slug) for
# tenant admins and members. Checked by tollgate.E021.
TOLLGATE_OIDC_ADMIN_GROUPS = env_list("TOLLGATE_OIDC_ADMIN_GROUPS", [])
TOLLGATE_OIDC_TENANT_ADMIN_GROUPS = env_list("TOLLGATE_OIDC_TENANT_ADMIN_GROUPS", [])
TOLLGATE_OIDC_MEMBER_GROUPS = env_list("TOLLGATE_OIDC_MEMBER_GROUPS", [])
TOLLGATE_OIDC_BUTTON_LABEL = env_str("TOLLGATE_OIDC_BUTTON_LABEL", "Sign in with single sign-on")
# SSO only: local passwords stop working, except the break-glass admin's.
TOLLGATE_SSO_ONLY = env_bool("TOLLGATE_SSO_ONLY", False)
TOLLGATE_BREAK_GLASS_USERNAME = (
    env_str("TOLLGATE_BREAK_GLASS_USERNAME") or env_str("TOLLGATE_ADMIN_USERNAME") or "admin"
)
# Answers only a provider's callback (with code and state) while SSO is on.
AUTHENTICATION_BACKENDS.append("tenants.sso.SSOBackend")

# HMAC pepper for API-key hashes. Kept apart from SECRET_KEY so that rotating one does not
# silently invalidate the other; derived from SECRET_KEY only when not set.
TOLLGATE_KEY_PEPPER = (
    env_secret("TOLLGATE_KEY_PEPPER")
    or hashlib.sha256(b"tollgate-key-pepper:" + SECRET_KEY.encode()).hexdigest()
)

# Key for secrets Tollgate stores encrypted (e.g. external engines' upstream keys);
# derived from DJANGO_SECRET_KEY when not set.
TOLLGATE_ENCRYPTION_KEY = env_secret("TOLLGATE_ENCRYPTION_KEY")

# Months close for billing this long after they end; late usage then becomes an adjustment.
TOLLGATE_PERIOD_CLOSE_GRACE_HOURS = env_int("TOLLGATE_PERIOD_CLOSE_GRACE_HOURS", 72)

# Served over HTTPS (directly or behind a TLS-terminating proxy): secure cookies, HSTS.
TOLLGATE_HTTPS = env_bool("TOLLGATE_HTTPS", False)
SESSION_COOKIE_SECURE = TOLLGATE_HTTPS
CSRF_COOKIE_SECURE = TOLLGATE_HTTPS
SECURE_SSL_REDIRECT = TOLLGATE_HTTPS and env_bool("TOLLGATE_SSL_REDIRECT", True)
SECURE_HSTS_SECONDS = env_int("TOLLGATE_HSTS_SECONDS", 31536000) if TOLLGATE_HTTPS else 0
SECURE_HSTS_INCLUDE_SUBDOMAINS = TOLLGATE_HTTPS
SECURE_HSTS_PRELOAD = TOLLGATE_HTTPS and env_bool("TOLLGATE_HSTS_PRELOAD", False)
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^metrics$"]
if env_bool("TOLLGATE_TRUST_X_FORWARDED_PROTO", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
SESSION_COOKIE_AGE = env_int("TOLLGATE_SESSION_SECONDS", 12 * 3600)
CSRF_COOKIE_HTTPONLY = False  # htmx reads the token from the cookie for partial updates
X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
SILENCED_SYSTEM_CHECKS = []
if PRODUCTION and not TOLLGATE_HTTPS:
    # Plain-HTTP appliances on a trusted LAN are supported; tollgate.W001 says so instead.
    SILENCED_SYSTEM_CHECKS += ["security.W004", "security.W008", "security.W012", "security.W016"]
if not SECURE_HSTS_PRELOAD:
    # Preloading binds a whole domain to HTTPS in every browser for good: the operator opts in.
    SILENCED_SYSTEM_CHECKS += ["security.W021"]

# --- REST API ---------------------------------------------------------------------------

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "tenants.auth.AdminTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "core.problems.exception_handler",
    "DEFAULT_PARSER_CLASSES": [
        "core.parsers.ObjectJSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Tollgate admin API",
    "DESCRIPTION": (
        "Manage tenants, API keys, members, models, prices, nodes, deployments and usage. "
        "Authenticate with an admin API token (`Authorization: Bearer tga-…`) or a console "
        "session. Inference (`/v1/…`) uses tenant API keys and is documented separately."
    ),
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "config.schema.postprocess",
    ],
}

# --- Engines and deployments ------------------------------------------------------------

# Engine images a deployment may use (fnmatch patterns). Nothing else is ever started.
TOLLGATE_ENGINE_IMAGES = env_list(
    "TOLLGATE_ENGINE_IMAGES",
    ["vllm/vllm-openai:*", "nvcr.io/nvidia/vllm:*", "tollgate/engine-sim:*", "tollgate/vllm-cpu:*"],
)
TOLLGATE_DOCKER_URL = env_str("TOLLGATE_DOCKER_URL", "unix:///var/run/docker.sock")
TOLLGATE_LOCAL_NODE_NAME = env_str("TOLLGATE_LOCAL_NODE_NAME", "local")
TOLLGATE_ENGINE_NETWORK = env_str("TOLLGATE_ENGINE_NETWORK", "tollgate-engines")
TOLLGATE_DEFAULT_CURRENCY = env_str("TOLLGATE_DEFAULT_CURRENCY", "USD")
# Every Tollgate stack sharing a Docker Engine labels its containers with its own id.
TOLLGATE_STACK_ID = env_str("TOLLGATE_STACK_ID", "tollgate")
TOLLGATE_MODEL_CACHE_VOLUME = env_str("TOLLGATE_MODEL_CACHE_VOLUME", "tollgate-model-cache")
TOLLGATE_COMPILE_CACHE_VOLUME = env_str("TOLLGATE_COMPILE_CACHE_VOLUME", "tollgate-compile-cache")
# always | missing | never: "never" for air-gapped nodes whose images are preloaded.
TOLLGATE_PULL_POLICY = env_str("TOLLGATE_PULL_POLICY", "missing")
TOLLGATE_ENGINE_READY_TIMEOUT = env_float("TOLLGATE_ENGINE_READY_TIMEOUT", 1800.0)
TOLLGATE_ENGINE_POLL_SECONDS = env_float("TOLLGATE_ENGINE_POLL_SECONDS", 1.0)
TOLLGATE_WARMUP_TIMEOUT = env_float("TOLLGATE_WARMUP_TIMEOUT", 120.0)
TOLLGATE_RESTART_BACKOFF_SECONDS = env_float("TOLLGATE_RESTART_BACKOFF_SECONDS", 10.0)
TOLLGATE_RESTART_BACKOFF_MAX_SECONDS = env_float("TOLLGATE_RESTART_BACKOFF_MAX_SECONDS", 300.0)
TOLLGATE_MAX_CRASHES = env_int("TOLLGATE_MAX_CRASHES", 5)
# A replica ready this long has its crash count forgiven.
TOLLGATE_CRASH_RESET_SECONDS = env_float("TOLLGATE_CRASH_RESET_SECONDS", 600.0)
TOLLGATE_ORPHAN_GRACE_SECONDS = env_float("TOLLGATE_ORPHAN_GRACE_SECONDS", 60.0)
TOLLGATE_DRAIN_TIMEOUT = env_float("TOLLGATE_DRAIN_TIMEOUT", 60.0)
TOLLGATE_STOP_GRACE_SECONDS = env_int("TOLLGATE_STOP_GRACE_SECONDS", 30)
TOLLGATE_RECONCILE_SECONDS = env_float("TOLLGATE_RECONCILE_SECONDS", 5.0)
# A running operation's worker renews its lease; a worker killed mid-operation stops
# renewing, and after this reconcile fails the operation and takes over.
TOLLGATE_OPERATION_LEASE_SECONDS = env_float("TOLLGATE_OPERATION_LEASE_SECONDS", 30.0)
# An operation still queued after this (its task message lost: Redis restarted, or was down
# as it was queued) has its task sent again by reconcile; a delivery twice runs it once.
TOLLGATE_OPERATION_PICKUP_SECONDS = env_float("TOLLGATE_OPERATION_PICKUP_SECONDS", 20.0)
# A node whose worker sent no heartbeat for this long is unreachable: its replicas leave
# routing and unpinned ones are placed on other nodes.
TOLLGATE_NODE_HEARTBEAT_TIMEOUT = env_float("TOLLGATE_NODE_HEARTBEAT_TIMEOUT", 30.0)
# How long a Ray head waits for its worker node(s) to join (and a worker for its head).
TOLLGATE_RAY_JOIN_TIMEOUT = env_float("TOLLGATE_RAY_JOIN_TIMEOUT", 300.0)
# Join tokens for new nodes expire after this long.
TOLLGATE_JOIN_TOKEN_HOURS = env_float("TOLLGATE_JOIN_TOKEN_HOURS", 24.0)
# The control plane's worker queue that runs joined nodes' work (their Docker calls go
# through each node's agent); the worker role consumes it (compose/entrypoint.sh). Fixed:
# tests give it a name of their own.
TOLLGATE_JOINED_NODE_QUEUE = "nodes"
TOLLGATE_TELEMETRY_TTL_SECONDS = env_int("TOLLGATE_TELEMETRY_TTL_SECONDS", 30)
TOLLGATE_LOG_TAIL_LINES = env_int("TOLLGATE_LOG_TAIL_LINES", 40)
# Size of each engine's private /dev/shm (Docker's --shm-size; used only as filled).
TOLLGATE_ENGINE_SHM_SIZE = env_str("TOLLGATE_ENGINE_SHM_SIZE", "16g")
# Environment names an engine may be given (fnmatch); deployments.engine_env.DENIED lists
# the names refused whatever this says.
TOLLGATE_ENGINE_ENV_ALLOWED = env_list(
    "TOLLGATE_ENGINE_ENV_ALLOWED",
    [
        "VLLM_*",
        "NCCL_*",
        "RAY_*",
        "CUDA_*",
        "HF_HUB_*",
        "TORCH_*",
        "PYTORCH_*",
        "OMP_NUM_THREADS",
        "TOKENIZERS_PARALLELISM",
        "SIM_*",
    ],
)
# How weights are staged: the engine image's Hugging Face CLI.
TOLLGATE_STAGE_ENTRYPOINT = env_list("TOLLGATE_STAGE_ENTRYPOINT", ["hf", "download"])
TOLLGATE_STAGE_TIMEOUT = env_float("TOLLGATE_STAGE_TIMEOUT", 6 * 3600.0)
# LoRA adapters (deployments/adapters.py): the largest adapter accepted, and how long a
# request for an adapter not loaded on any replica waits for a worker to load one.
TOLLGATE_ADAPTER_MAX_BYTES = env_int("TOLLGATE_ADAPTER_MAX_BYTES", 2 * 1024**3)
# Uploaded adapters' checked archives (deployments/adapter_files.py): written by web, read by
# the worker, which copies them into nodes' model caches. The appliance mounts one volume
# here in both (and in no other service).
TOLLGATE_UPLOAD_DIR = env_str("TOLLGATE_UPLOAD_DIR", str(BASE_DIR / "var" / "uploads"))
# Uploaded files are cut off while they are read once past their route's limit (the adapter
# and batch limits): a too large body never fills memory or the temporary folder.
FILE_UPLOAD_HANDLERS = [
    "core.uploads.BoundedUploadHandler",
    "django.core.files.uploadhandler.MemoryFileUploadHandler",
    "django.core.files.uploadhandler.TemporaryFileUploadHandler",
]
TOLLGATE_ADAPTER_LOAD_TIMEOUT = env_float("TOLLGATE_ADAPTER_LOAD_TIMEOUT", 60.0)
# When every replica holding an adapter has this share of its sequences busy (this gateway
# process's count), the adapter is loaded on one more replica of its base.
TOLLGATE_ADAPTER_SPREAD_LOAD = env_float("TOLLGATE_ADAPTER_SPREAD_LOAD", 1.0)
# "loaded": an adapter's requests go to the replicas holding it (the default); "ignore": to
# the least-loaded replica of its base, loading it there if need be (to compare against).
TOLLGATE_ADAPTER_ROUTING = env_str("TOLLGATE_ADAPTER_ROUTING", "loaded")
# The Celery queue of what the gateway asks for on a request's behalf (adapter loads,
# on-demand starts), consumed by the control plane's worker, which reaches every engine (as
# its telemetry scrapes do). A queue of its own: the gateway's Redis user may push to it
# (config/redisacl.py), never to the control queue.
TOLLGATE_DEMAND_QUEUE = env_str("TOLLGATE_DEMAND_QUEUE", "demand")
# An on-demand model used this recently counts as in use and is never put to sleep to make
# room for another (the gateway touches models with requests in flight every 2 s).
TOLLGATE_DEMAND_BUSY_SECONDS = env_float("TOLLGATE_DEMAND_BUSY_SECONDS", 15.0)
# Given to engines and staging helpers for gated models; never logged or audited.
HF_TOKEN = env_secret("HF_TOKEN")

# --- Batch API (/v1/files, /v1/batches) ---------------------------------------------------

# Where the batch runner sends requests: the gateway itself, not the public URL.
TOLLGATE_INTERNAL_URL = env_str("TOLLGATE_INTERNAL_URL", "http://127.0.0.1:8000")
TOLLGATE_BATCH_MAX_FILE_BYTES = env_int("TOLLGATE_BATCH_MAX_FILE_BYTES", 100 * 1024 * 1024)
TOLLGATE_BATCH_MAX_LINES = env_int("TOLLGATE_BATCH_MAX_LINES", 50_000)
TOLLGATE_BATCH_CONCURRENCY = env_int("TOLLGATE_BATCH_CONCURRENCY", 4)  # requests in flight
TOLLGATE_BATCH_QUEUE = env_str("TOLLGATE_BATCH_QUEUE", "batches")
TOLLGATE_BATCH_LEASE_SECONDS = env_int("TOLLGATE_BATCH_LEASE_SECONDS", 120)
TOLLGATE_BATCH_REQUEST_TIMEOUT = env_float("TOLLGATE_BATCH_REQUEST_TIMEOUT", 600.0)
TOLLGATE_BATCH_MAX_ATTEMPTS = env_int("TOLLGATE_BATCH_MAX_ATTEMPTS", 10)
TOLLGATE_BATCH_MAX_RETRY_AFTER = env_float("TOLLGATE_BATCH_MAX_RETRY_AFTER", 60.0)
TOLLGATE_FILES_RETENTION_DAYS = env_int("TOLLGATE_FILES_RETENTION_DAYS", 30)

# --- Alerts, webhooks and budgets (docs/admins/alerts.md) --------------------------------

# Seconds to wait for a webhook receiver's answer (redirects are never followed).
TOLLGATE_WEBHOOK_TIMEOUT = env_float("TOLLGATE_WEBHOOK_TIMEOUT", 5.0)
# Seconds before each retry of a failed delivery; after the last retry fails it is given up.
TOLLGATE_WEBHOOK_RETRY_SCHEDULE = env_int_list(
    "TOLLGATE_WEBHOOK_RETRY_SCHEDULE", [30, 120, 600, 3600, 21600]
)
# How often budgets (tenant quotas, key budgets) are checked against their thresholds.
TOLLGATE_BUDGET_CHECK_SECONDS = env_float("TOLLGATE_BUDGET_CHECK_SECONDS", 30.0)

# --- The bill checked against the engines (metering/engine_ledger.py) -----------------------

# How often the worker compares each replica's billed tokens with its engine's counters.
TOLLGATE_ENGINE_LEDGER_SECONDS = env_float("TOLLGATE_ENGINE_LEDGER_SECONDS", 5.0)
# A stretch whose tokens differ from the engine's by more than this many tokens AND this
# share of the engine's count raises the alert (console banner, log line, webhook).
TOLLGATE_ENGINE_DRIFT_ALERT_TOKENS = env_int("TOLLGATE_ENGINE_DRIFT_ALERT_TOKENS", 0)
TOLLGATE_ENGINE_DRIFT_ALERT_PERCENT = env_float("TOLLGATE_ENGINE_DRIFT_ALERT_PERCENT", 0.0)
# Tokens an engine may generate for a request after Tollgate closed it (the client left, or
# a preemption) before its abort lands: made, never delivered, so never billed.
TOLLGATE_ENGINE_ABORT_ALLOWANCE_TOKENS = env_int("TOLLGATE_ENGINE_ABORT_ALLOWANCE_TOKENS", 64)
# Tests only (ignored in production): lose every Nth usage event on purpose.
TOLLGATE_TEST_DROP_USAGE_EVERY = env_int("TOLLGATE_TEST_DROP_USAGE_EVERY", 0)

# --- Periodic tasks -------------------------------------------------------------------------

# Each app lists its periodic tasks in its own schedule module (plain dicts, no imports).
from alerts.schedule import BEAT_SCHEDULE as _alerts_beat  # noqa: E402
from batches.schedule import BEAT_SCHEDULE as _batches_beat  # noqa: E402
from deployments.schedule import beat_schedule as _deployments_beat  # noqa: E402
from gateway.schedule import BEAT_SCHEDULE as _gateway_beat  # noqa: E402
from metering.schedule import BEAT_SCHEDULE as _metering_beat  # noqa: E402
from metering.schedule import budget_schedule as _budget_beat  # noqa: E402
from metering.schedule import engine_ledger_schedule as _ledger_beat  # noqa: E402

CELERY_BEAT_SCHEDULE = {
    **_deployments_beat(TOLLGATE_RECONCILE_SECONDS),
    **_metering_beat,
    **_gateway_beat,
    **_batches_beat,
    **_alerts_beat,
    **_budget_beat(TOLLGATE_BUDGET_CHECK_SECONDS),
    **_ledger_beat(TOLLGATE_ENGINE_LEDGER_SECONDS),
}

# --- Gateway (/v1) -------------------------------------------------------------------------

# The largest body on /v1, and on the console's and /api's routes that take no file
# (core/uploads.py; those that take one have the file's limit).
TOLLGATE_MAX_BODY_BYTES = env_int("TOLLGATE_MAX_BODY_BYTES", 8 * 1024 * 1024)
TOLLGATE_MAX_N = env_int("TOLLGATE_MAX_N", 8)  # choices per request (n, best_of)
# The engine shield's bounds (gateway/shield.py, docs/admins/engine-shield.md): logprobs per
# token, items in a request's big lists (messages, inputs, documents), tools per request;
# and for structured outputs, each JSON schema's (or grammar's) size and nesting, the
# alternatives one enum/anyOf/oneOf/choice lists, and how far counted repetitions in a
# regular expression or grammar ({m,n}, nested ones multiplied) may go.
TOLLGATE_SHIELD_MAX_LOGPROBS = env_int("TOLLGATE_SHIELD_MAX_LOGPROBS", 20)
TOLLGATE_SHIELD_MAX_ITEMS = env_int("TOLLGATE_SHIELD_MAX_ITEMS", 10_000)
TOLLGATE_SHIELD_MAX_TOOLS = env_int("TOLLGATE_SHIELD_MAX_TOOLS", 128)
TOLLGATE_SHIELD_MAX_SCHEMA_BYTES = env_int("TOLLGATE_SHIELD_MAX_SCHEMA_BYTES", 64 * 1024)
TOLLGATE_SHIELD_MAX_SCHEMA_DEPTH = env_int("TOLLGATE_SHIELD_MAX_SCHEMA_DEPTH", 64)
TOLLGATE_SHIELD_MAX_CHOICES = env_int("TOLLGATE_SHIELD_MAX_CHOICES", 4096)
TOLLGATE_SHIELD_MAX_REPEAT = env_int("TOLLGATE_SHIELD_MAX_REPEAT", 10_000)
TOLLGATE_MAX_SSE_FRAME_BYTES = env_int("TOLLGATE_MAX_SSE_FRAME_BYTES", 1024 * 1024)
# The gateway's HTTP client for engines: its own keep-alive client (gateway/upstream.py) or
# an aiohttp session; bench/gateway_bench.py measures both.
TOLLGATE_UPSTREAM_CLIENT = env_str("TOLLGATE_UPSTREAM_CLIENT", "tollgate")
# Admission: how long a request may wait for an engine slot, per priority class.
TOLLGATE_QUEUE_TIMEOUT_SECONDS = {
    "P0": env_int("TOLLGATE_QUEUE_TIMEOUT_P0", 30),
    "P1": env_int("TOLLGATE_QUEUE_TIMEOUT_P1", 60),
    "P2": env_int("TOLLGATE_QUEUE_TIMEOUT_P2", 600),
}
# A gateway process renews its in-flight requests' leases; when it dies they lapse after this
# and the reaper bills what those requests delivered and frees their engine slots.
TOLLGATE_GATEWAY_LEASE_SECONDS = env_float("TOLLGATE_GATEWAY_LEASE_SECONDS", 30.0)
# Kept /v1/responses answers stay this long in Redis (for immediate chaining from any
# gateway process); PostgreSQL keeps them TOLLGATE_RESPONSES_RETENTION_DAYS (0: until
# deleted), as OpenAI keeps them 30 days (gateway/response_store.py).
TOLLGATE_RESPONSES_CACHE_SECONDS = env_int("TOLLGATE_RESPONSES_CACHE_SECONDS", 24 * 3600)
TOLLGATE_RESPONSES_RETENTION_DAYS = env_int("TOLLGATE_RESPONSES_RETENTION_DAYS", 30)
# P2 (batch) runs only while engines report KV-cache use below this and nothing waiting.
TOLLGATE_P2_KV_CACHE_THRESHOLD = env_float("TOLLGATE_P2_KV_CACHE_THRESHOLD", 0.9)
# Headroom for higher classes (gateway/acquire.lua): lower classes leave free the slots P0/P1
# needed at once within the last 1-2 windows of this many seconds (0: off). It costs
# throughput while higher classes keep coming (those slots idle between their requests) and
# buys them a free slot on engines that serve first come, first served.
TOLLGATE_ADMISSION_HEADROOM_SECONDS = env_float("TOLLGATE_ADMISSION_HEADROOM_SECONDS", 5.0)
# The headroom never exceeds this share of a model's slot budget.
TOLLGATE_ADMISSION_HEADROOM_MAX_SHARE = env_float("TOLLGATE_ADMISSION_HEADROOM_MAX_SHARE", 0.5)
# On every engine (vLLM's priority scheduling never preempts for a slot), a P0/P1
# request that finds every slot taken preempts the youngest lower-class chat/completions
# request: the gateway aborts it upstream and resumes it when a slot frees, continuing from
# what its client already received (one uninterrupted stream, billed once). It costs the
# recompute of the preempted request's prompt and partial output (the operator's, not the
# tenant's); off, P0 relies on the headroom alone and may wait for a lower-class reply.
TOLLGATE_ADMISSION_PREEMPT_FCFS = env_bool("TOLLGATE_ADMISSION_PREEMPT_FCFS", True)
# A request is preempted at most this many times; then it runs to its end.
TOLLGATE_ADMISSION_PREEMPT_MAX_TIMES = env_int("TOLLGATE_ADMISSION_PREEMPT_MAX_TIMES", 2)
# Requests' predicted tokens (prompt + expected output) in flight may fill this share of the
# engines' KV cache (from their /metrics); 0: admit by request count only.
TOLLGATE_ADMISSION_KV_SHARE = env_float("TOLLGATE_ADMISSION_KV_SHARE", 0.95)
# Which replica of a model serves a request (gateway/routing.py): "prefix" (the one that last
# served the request's longest prefix, within the load bound; else the least loaded),
# "least_loaded" or "round_robin".
TOLLGATE_ROUTING = env_str("TOLLGATE_ROUTING", "prefix")
# Prefix routing keeps a replica while its load (in flight / slots) stays within this factor
# of the mean: higher keeps more cache hits, lower keeps replicas more evenly loaded.
TOLLGATE_ROUTING_LOAD_FACTOR = env_float("TOLLGATE_ROUTING_LOAD_FACTOR", 1.25)
# Expected output tokens of a request that asks for more, until a model's mean is learnt.
TOLLGATE_ADMISSION_EXPECTED_OUTPUT = env_int("TOLLGATE_ADMISSION_EXPECTED_OUTPUT", 512)
# Bearer token for the gateway's /metrics; empty: /metrics is not served.
TOLLGATE_METRICS_TOKEN = env_secret("TOLLGATE_METRICS_TOKEN")
# Where the console's playground sends its chat requests (the gateway, like any client);
# empty: this very server over loopback, on the port the request came in on.
TOLLGATE_PLAYGROUND_UPSTREAM = env_str("TOLLGATE_PLAYGROUND_UPSTREAM", "")

# --- I18N, static ---------------------------------------------------------------------

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {
        "BACKEND": "servestatic.storage.CompressedManifestStaticFilesStorage"
        if PRODUCTION
        else "django.contrib.staticfiles.storage.StaticFilesStorage"
    },
}

# --- Logging ----------------------------------------------------------------------------

LOG_LEVEL = env_str("TOLLGATE_LOG_LEVEL", "INFO")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {
        "redact_keys": {"()": "config.logging.RedactSecretsFilter"},
        "refusals_in_one_line": {"()": "config.logging.RefusalsInOneLineFilter"},
    },
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "plain",
            "filters": ["redact_keys"],
        }
    },
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        "django.db.backends": {"level": "INFO"},
        # httpx logs every request's full URL at INFO; a webhook URL may hold a token (a chat
        # tool's incoming-webhook URL), so only its warnings are logged.
        "httpx": {"level": "WARNING"},
        # A refused request (403) is one line, not the PermissionDenied traceback.
        "django.request": {"filters": ["refusals_in_one_line"]},
        "django.security": {"filters": ["refusals_in_one_line"]},
    },
}
