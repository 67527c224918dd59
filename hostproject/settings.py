"""Settings of the host project that runs the repository standalone.

Deployment knobs come from the environment so that tests and the demo can point the same code at their own
database, Redis and secret without editing files:

``DJANGO_SECRET_KEY``   default: a random key generated once into ``var/secret_key`` (never committed)
``DJANGO_DEBUG``        ``1`` for development
``DJANGO_ALLOWED_HOSTS`` comma-separated; default: localhost only
``DATABASE_URL``        the database, e.g. ``postgres://user:password@host:5432/llmserve`` (PostgreSQL is the
                        production choice: several web and Celery processes write at once); unset: SQLite
``LLMSERVE_DB_POOL_SIZE`` PostgreSQL connections per process (default 8; requests wait for a free one)
``LLMSERVE_DB_PATH``    SQLite database file when ``DATABASE_URL`` is unset (default: ``db.sqlite3`` here)
``LLMSERVE_REDIS_URL``  Redis of the request bus (also Celery's broker unless ``CELERY_BROKER_URL`` is set)
``LLMSERVE_OPEN_ACCESS`` ``1`` serves the API without API keys
``LLMSERVE_ALLOW_RUNTIME_LORA_UPDATING`` ``1`` serves /v1/load_lora_adapter and /v1/unload_lora_adapter
``LLMSERVE_CORS_ALLOWED_ORIGINS`` comma-separated origins (``https://app.example.com``) whose pages may call
                        the API from the browser (CORS); default: none
``PROMETHEUS_MULTIPROC_DIR`` where the web processes keep their metrics (default: ``var/prometheus``; the run
                        command empties it at start)
``DJANGO_HTTPS``        ``1`` when users reach the site over HTTPS (directly or through a proxy): secure
                        cookies, HSTS (``DJANGO_HSTS_SECONDS``, default a year; ``DJANGO_HSTS_PRELOAD=0``
                        leaves out ``preload``), HTTP redirected to HTTPS except ``/health`` and ``/metrics``
``DJANGO_SECURE_PROXY_SSL_HEADER`` ``1`` trusts ``X-Forwarded-Proto: https`` from the proxy in front (only
                        behind a proxy that sets that header itself, overwriting what clients send)
``LLMSERVE_LOGIN_FAILURE_LIMIT`` failed sign-ins (admin and chat) from one address for one user name before
                        that pair is locked out (default 5), for ``LLMSERVE_LOGIN_COOLOFF_MINUTES``
                        (default 15)
"""

import os
import secrets
from datetime import timedelta
from pathlib import Path

import dj_database_url
from corsheaders.defaults import default_headers as default_cors_headers

BASE_DIR = Path(__file__).resolve().parent.parent

DEBUG = os.environ.get("DJANGO_DEBUG", "") == "1"


def _secret_key() -> str:
    """From the environment, else a per-checkout random key kept in var/ (a fresh clone just works, and no
    key is ever committed)."""
    if os.environ.get("DJANGO_SECRET_KEY"):
        return os.environ["DJANGO_SECRET_KEY"]
    path = BASE_DIR / "var" / "secret_key"
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(secrets.token_urlsafe(50))
    return path.read_text().strip()


SECRET_KEY = _secret_key()
ALLOWED_HOSTS = os.environ.get("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost,[::1]").split(",")

INSTALLED_APPS = [
    "daphne",  # first: its runserver serves ASGI (HTTP streaming and WebSockets)
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "corsheaders",  # CORS for browser apps on other origins (the API's views apply it too: llmserve.api)
    "drf_spectacular_sidecar",  # Swagger UI's files for the API docs page (/docs), served as static files
    "axes",  # login throttling
    "llmserve",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "corsheaders.middleware.CorsMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "axes.middleware.AxesMiddleware",  # turns a lockout into its 429 page
]

AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",  # first: refuses a locked-out sign-in before any password check
    "django.contrib.auth.backends.ModelBackend",
]

ROOT_URLCONF = "hostproject.urls"
LOGIN_URL = "login"  # the chat's sign-in page (templates/registration/login.html), not the admin's
LOGIN_REDIRECT_URL = "llmserve:chat"
LOGOUT_REDIRECT_URL = "login"

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
            ],
        },
    },
]

ASGI_APPLICATION = "hostproject.asgi.application"

if os.environ.get("DATABASE_URL"):
    DATABASES = {"default": dj_database_url.config()}
    if DATABASES["default"]["ENGINE"].endswith("postgresql"):
        # Each ASGI request runs its queries in a thread of its own; without a pool, a crowd of requests would
        # open as many connections as the server allows and fail past that. With it they wait for one.
        pool_size = int(os.environ.get("LLMSERVE_DB_POOL_SIZE", "8"))
        DATABASES["default"]["OPTIONS"] = {"pool": {"min_size": 1, "max_size": pool_size, "timeout": 60}}
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": os.environ.get("LLMSERVE_DB_PATH") or BASE_DIR / "db.sqlite3",
            # Async views and Celery workers write concurrently: wait for the lock instead of failing at once.
            "OPTIONS": {"timeout": 20},
        }
    }

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "var" / "static"
MEDIA_ROOT = BASE_DIR / "var" / "media"  # LoRA adapters uploaded in the admin go to its lora/ folder

REDIS_URL = os.environ.get("LLMSERVE_REDIS_URL")

# prometheus_client's multiprocess mode, so that /metrics adds up every web worker; it reads the variable when
# first imported, which is after the settings.
os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", str(BASE_DIR / "var" / "prometheus"))
Path(os.environ["PROMETHEUS_MULTIPROC_DIR"]).mkdir(parents=True, exist_ok=True)

# Login throttling (django-axes): failed sign-ins are counted in Redis (a cache every web worker shares), or
# without Redis in the database; a user name is locked out from the address that failed, so a stranger cannot
# lock the admin out from elsewhere. A success resets the count.
if REDIS_URL:
    CACHES = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "axes": {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_URL},
    }
    AXES_HANDLER, AXES_CACHE = "axes.handlers.cache.AxesCacheHandler", "axes"
else:
    AXES_HANDLER = "axes.handlers.database.AxesDatabaseHandler"
AXES_FAILURE_LIMIT = int(os.environ.get("LLMSERVE_LOGIN_FAILURE_LIMIT", "5"))
AXES_COOLOFF_TIME = timedelta(minutes=float(os.environ.get("LLMSERVE_LOGIN_COOLOFF_MINUTES", "15")))
AXES_LOCKOUT_PARAMETERS = [["ip_address", "username"]]
AXES_RESET_ON_SUCCESS = True

# Served over HTTPS (see the module docstring): what `manage.py check --deploy` asks for.
HTTPS = os.environ.get("DJANGO_HTTPS", "") == "1"
if os.environ.get("DJANGO_SECURE_PROXY_SSL_HEADER", "") == "1":
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
if HTTPS:
    SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = True
    SECURE_SSL_REDIRECT = True
    SECURE_REDIRECT_EXEMPT = [r"^health$", r"^metrics$"]  # probes on the loopback speak plain HTTP
    SECURE_HSTS_SECONDS = int(os.environ.get("DJANGO_HSTS_SECONDS", str(365 * 24 * 3600)))
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = os.environ.get("DJANGO_HSTS_PRELOAD", "1") == "1"

LLMSERVE = {
    "REDIS_URL": REDIS_URL,
    "OPEN_ACCESS": os.environ.get("LLMSERVE_OPEN_ACCESS", "") == "1",
    "ALLOW_RUNTIME_LORA_UPDATING": os.environ.get("LLMSERVE_ALLOW_RUNTIME_LORA_UPDATING", "") == "1",
}

# Browser apps on these origins may call the API with an API key (no cookies: credentials stay disallowed).
CORS_ALLOWED_ORIGINS = [o for o in os.environ.get("LLMSERVE_CORS_ALLOWED_ORIGINS", "").split(",") if o]
CORS_ALLOW_HEADERS = (
    *default_cors_headers,
    # what OpenAI's JavaScript SDK sends
    "openai-organization",
    "openai-project",
    "openai-beta",
    "x-stainless-arch",
    "x-stainless-async",
    "x-stainless-lang",
    "x-stainless-os",
    "x-stainless-package-version",
    "x-stainless-retry-count",
    "x-stainless-runtime",
    "x-stainless-runtime-version",
    "x-stainless-timeout",
)
CORS_EXPOSE_HEADERS = ["retry-after"]

CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL") or REDIS_URL or "redis://127.0.0.1:6379/0"
CELERY_RESULT_BACKEND = None  # llmserve stores job results in its own models
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# A task whose worker died (SIGKILL, OOM, lost machine) is redelivered once its message has been
# unacknowledged this long; bulk job tasks hand over to a fresh task every LLMSERVE["BULK_SLICE_SECONDS"]
# (60 s), well within it.
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": int(os.environ.get("CELERY_VISIBILITY_TIMEOUT", "300")),
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
    "loggers": {"llmserve": {"level": os.environ.get("LLMSERVE_LOG_LEVEL", "INFO")}},
}
