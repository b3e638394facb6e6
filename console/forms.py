"""Console forms. They only shape input; every rule runs in the service the view calls."""

import json
from datetime import timedelta
from decimal import Decimal
from typing import Any

from django import forms
from django.utils import timezone

from alerts.choices import SUBSCRIBABLE, Event
from deployments.choices import Arch, DeploymentMode, NodeStatus, Visibility
from deployments.models import (
    ADAPTER_FIELDS,
    MODEL_FIELDS,
    Adapter,
    CatalogModel,
    Deployment,
    EngineProfile,
    Node,
)
from tenants.choices import Role
from tenants.models import BUDGET_FIELDS, LIMIT_FIELDS, TENANT_FIELDS, ApiKey, Tenant

LIMIT_LABELS = {
    "requests_per_minute": "Requests per minute",
    "tokens_per_minute": "Tokens per minute",
    "max_concurrent_requests": "Concurrent requests (max)",
}
UNLIMITED = "Empty: unlimited."
BUDGET_HELP = (
    "Alerts the tenant's admins at the tenant's thresholds; it warns and never blocks "
    "requests (the tenant's quota is what stops them). Empty: no budget."
)


class DateTimeInput(forms.DateTimeInput):
    input_type = "datetime-local"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(format="%Y-%m-%dT%H:%M", **kwargs)


class TenantForm(forms.ModelForm):
    class Meta:
        model = Tenant
        fields = TENANT_FIELDS
        labels = {
            **LIMIT_LABELS,
            "quota_tokens": "Token quota per period (tokens)",
            "quota_amount": "Money quota per period",
            "priority": "Priority class",
            "model_access": "Model access",
            "allowed_models": "Listed models",
            "fair_share_weight": "Fair share weight",
            "alert_thresholds": "Budget alert thresholds (%)",
        }
        help_texts = {
            **{f: UNLIMITED for f in LIMIT_FIELDS},
            "slug": "Short name used in URLs and exports; derived from the name when empty.",
            "quota_tokens": "Prompt + completion tokens per quota period. Empty: no token quota.",
            "quota_amount": "In the tenant's currency per quota period. Empty: no money quota.",
            "currency": "ISO 4217 code, e.g. USD or EUR; prices are looked up in it.",
            "allowed_models": "Only used with “Only the listed models”.",
            "priority": "P0 requests are admitted before P1, P1 before P2 (batch).",
            "fair_share_weight": "The tenant's share of a saturated model among tenants of the "
            "same priority class. Empty: 1 for a new tenant, unchanged on edit.",
            "alert_thresholds": "Percentages of each quota (and of each key's budget) at which "
            "the tenant's admins are alerted, separated by commas, e.g. 50, 80, 100. Each fires "
            "once per period. Empty: no budget alerts.",
        }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["slug"].required = False
        self.fields["fair_share_weight"].required = False

    def service_data(self) -> dict[str, Any]:
        data = dict(self.cleaned_data)
        data["allowed_models"] = list(data.get("allowed_models") or [])
        for name in ("slug", "fair_share_weight"):
            if data.get(name) in (None, ""):
                data.pop(name, None)
        return data


class KeyForm(forms.Form):
    tenant = forms.ModelChoiceField(queryset=Tenant.objects.none())
    name = forms.CharField(
        max_length=100, help_text="What the key is for, e.g. “notebook” or “CI”."
    )
    expires_at = forms.DateTimeField(
        required=False,
        widget=DateTimeInput(),
        label="Expires at (UTC)",
        help_text="Empty: never expires. Revoke a key to end it now.",
    )
    requests_per_minute = forms.IntegerField(
        required=False,
        min_value=1,
        label=LIMIT_LABELS["requests_per_minute"],
        help_text="Empty: the tenant's limit.",
    )
    tokens_per_minute = forms.IntegerField(
        required=False,
        min_value=1,
        label=LIMIT_LABELS["tokens_per_minute"],
        help_text="Empty: the tenant's limit.",
    )
    max_concurrent_requests = forms.IntegerField(
        required=False,
        min_value=1,
        label=LIMIT_LABELS["max_concurrent_requests"],
        help_text="Empty: the tenant's limit.",
    )
    budget_tokens = forms.IntegerField(
        required=False,
        min_value=1,
        label="Token budget per quota period (tokens)",
        help_text=BUDGET_HELP,
    )
    budget_amount = forms.DecimalField(
        required=False,
        min_value=0,
        max_digits=14,
        decimal_places=4,
        label="Money budget per quota period",
        help_text="In the tenant's currency. " + BUDGET_HELP,
    )
    allowed_models = forms.ModelMultipleChoiceField(
        queryset=CatalogModel.objects.none(),
        required=False,
        label="Restrict to models",
        help_text="Empty: every model the tenant may use.",
    )

    def __init__(
        self, *args: Any, tenants: Any, models: Any, editing: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.fields["tenant"].queryset = tenants
        self.fields["allowed_models"].queryset = models
        if editing:
            del self.fields["tenant"]

    def service_data(self) -> dict[str, Any]:
        data = dict(self.cleaned_data)
        data.pop("tenant", None)
        data["allowed_models"] = list(data.get("allowed_models") or [])
        return data

    @classmethod
    def initial_for(cls, key: ApiKey) -> dict[str, Any]:
        return {
            "name": key.name,
            "expires_at": key.expires_at,
            **{f: getattr(key, f) for f in (*LIMIT_FIELDS, *BUDGET_FIELDS)},
            "allowed_models": list(key.allowed_models.all()),
        }


class FieldNamesField(forms.CharField):
    """A list of names typed as one line, separated by commas or spaces."""

    def prepare_value(self, value: Any) -> Any:
        return ", ".join(value) if isinstance(value, list) else value

    def to_python(self, value: Any) -> list[str]:
        text = super().to_python(value)
        return [name for name in text.replace(",", " ").split() if name]


class CatalogModelForm(forms.ModelForm):
    allowed_request_fields = FieldNamesField(
        required=False,
        label="Request fields allowed",
        help_text="Fields the engine shield otherwise refuses, separated by commas: "
        "chat_template, chat_template_kwargs (any key) or chat_template_kwargs.<key>, "
        "mm_processor_kwargs, media_io_kwargs, vllm_xargs, session_id. Empty: none "
        "(docs: Admins › The engine shield).",
    )

    class Meta:
        model = CatalogModel
        fields = MODEL_FIELDS
        labels = {
            "served_name": "Served name",
            "params_billions": "Parameters (billions)",
            "active_params_billions": "Active parameters (billions)",
            "context_length": "Context length (tokens)",
            "kv_bytes_per_token": "KV cache (bytes per token)",
        }
        help_texts = {
            "served_name": "The name tenants pass as `model`.",
            "source": "Hugging Face repo id (org/name) or an absolute path in the model cache.",
        }
        widgets = {"description": forms.Textarea(attrs={"rows": 3})}


class PriceForm(forms.Form):
    currency = forms.CharField(max_length=3, initial="USD", help_text="ISO 4217, e.g. USD.")
    input_per_mtok = forms.DecimalField(
        min_value=0, decimal_places=6, max_digits=14, label="Input, per 1M tokens"
    )
    cached_input_per_mtok = forms.DecimalField(
        min_value=0,
        decimal_places=6,
        max_digits=14,
        required=False,
        label="Cached input, per 1M tokens",
        help_text="Empty: same as input.",
    )
    output_per_mtok = forms.DecimalField(
        min_value=0, decimal_places=6, max_digits=14, label="Output, per 1M tokens"
    )
    effective_from = forms.DateTimeField(
        required=False,
        widget=DateTimeInput(),
        label="Effective from (UTC)",
        help_text="Empty: now. Prices are never backdated.",
    )

    def clean_currency(self) -> str:
        return self.cleaned_data["currency"].upper()


class GrantForm(forms.Form):
    tenant = forms.ModelChoiceField(queryset=Tenant.objects.all(), to_field_name="slug")


class AdapterForm(forms.Form):
    """A LoRA adapter. Tenant admins name it, its base and files; platform admins also choose
    its owner, visibility and grants."""

    served_name = forms.CharField(
        max_length=128,
        help_text="The name clients pass as “model”; no model or other adapter may have it.",
    )
    base = forms.ModelChoiceField(
        queryset=CatalogModel.objects.none(),
        label="Base model",
        help_text="The model it was trained on; the base's engines serve it.",
    )
    tenant = forms.ModelChoiceField(
        queryset=Tenant.objects.none(),
        required=False,
        to_field_name="slug",
        label="Owner",
        help_text="Its admins manage it.",
    )
    source = forms.CharField(
        max_length=255,
        required=False,
        help_text="A Hugging Face repo id (org/name; downloaded into each node's cache if it "
        "is not there) or an absolute folder in the model cache; or upload the files below. "
        "Its files are checked before anyone can call it.",
    )
    archive = forms.FileField(
        required=False,
        label="Or upload its files",
        help_text="A .tar, .tar.gz or .zip of adapter_config.json, *.safetensors weights and "
        "harmless text files (README.md …), checked before it is accepted.",
        widget=forms.ClearableFileInput(attrs={"accept": ".tar,.tgz,.tar.gz,.zip"}),
    )
    description = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 3}))
    pinned = forms.BooleanField(
        required=False,
        label="Keep it loaded",
        help_text="On every replica of the base, not only after it was used.",
    )
    visibility = forms.ChoiceField(choices=Visibility.choices, initial=Visibility.PRIVATE)
    grants = forms.ModelMultipleChoiceField(
        queryset=Tenant.objects.none(),
        required=False,
        label="Also granted to",
        help_text="Private adapters: other tenants that may call it too.",
    )

    def __init__(
        self,
        *args: Any,
        staff: bool,
        tenants: Any,
        bases: Any,
        owner: Tenant | None = None,
        editing: bool = False,
        **kwargs: Any,
    ) -> None:
        """``tenants``: who may own it; ``owner``: the one owner when there is no choice."""
        super().__init__(*args, **kwargs)
        self.owner, self.editing = owner, editing
        if editing:
            self.fields["archive"].label = "Or upload new files"
            self.fields["archive"].help_text += " They replace the adapter's and are checked again."
        self.fields["base"].queryset = bases
        self.fields["tenant"].queryset = tenants
        if staff:
            self.fields["tenant"].empty_label = "None: the platform's own"
            self.fields["grants"].queryset = Tenant.objects.order_by("name")
            return
        # Sharing it and keeping it loaded on shared engines are platform admins' choices.
        for name in ("visibility", "grants", "pinned"):
            del self.fields[name]
        if owner is not None or editing:
            del self.fields["tenant"]
        else:
            self.fields["tenant"].required = True

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if self.editing and data.get("archive") and "source" in self.changed_data:
            self.add_error("archive", "Change the source or upload new files, not both.")
        elif not self.editing and bool(data.get("source")) == bool(data.get("archive")):
            self.add_error(
                "source", "Give a hub id or a folder in the model cache, or upload the files."
            )
        elif self.editing and not data.get("source") and not data.get("archive"):
            self.add_error("source", "This field is required.")
        return data

    def uploaded(self) -> Any:
        """The uploaded archive, if any (``service_data`` leaves it out)."""
        return self.cleaned_data.get("archive")

    def service_data(self) -> dict[str, Any]:
        """The adapter's fields for the service (the grants apart: ``granted()``; the
        archive apart: ``uploaded()``)."""
        data = {k: v for k, v in self.cleaned_data.items() if k not in ("grants", "archive")}
        if self.uploaded():
            data.pop("source", None)
        if "tenant" not in self.fields and not self.editing:
            data["tenant"] = self.owner
        return data

    def granted(self) -> list[Tenant] | None:
        """The tenants to grant it to; None when this form does not set grants."""
        if "grants" not in self.fields:
            return None
        return list(self.cleaned_data.get("grants") or [])

    @classmethod
    def initial_for(cls, adapter: Adapter) -> dict[str, Any]:
        return {
            **{name: getattr(adapter, name) for name in ADAPTER_FIELDS},
            "tenant": adapter.tenant.slug if adapter.tenant else None,
            "grants": list(adapter.granted_tenants.all()),
        }


class NodeForm(forms.ModelForm):
    total_memory_gb = forms.DecimalField(
        required=False,
        min_value=0,
        label="Total memory (GB)",
        help_text=(
            "Filled in by the node's heartbeat; set it now to check memory fit before the "
            "first one."
        ),
    )
    gpu_memory_gb = forms.DecimalField(
        required=False,
        min_value=0,
        label="Dedicated GPU memory (GB)",
        help_text="0 on unified-memory nodes such as the DGX Spark.",
    )

    class Meta:
        model = Node
        fields = [
            "name",
            "docker_url",
            "queue",
            "engine_host",
            "arch",
            "gpu_description",
            "gpu_count",
            "unified_memory",
            "status",
        ]
        labels = {"docker_url": "Docker URL", "gpu_count": "GPUs", "gpu_description": "GPU"}
        help_texts = {"queue": "Celery queue of the node's worker; empty: node.<name>."}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["queue"].required = False
        self.fields["arch"].initial = Arch.ARM64
        self.fields["status"].initial = NodeStatus.ONLINE

    def service_data(self) -> dict[str, Any]:
        data = dict(self.cleaned_data)
        for name, target in (
            ("total_memory_gb", "total_memory_bytes"),
            ("gpu_memory_gb", "gpu_memory_bytes"),
        ):
            value = data.pop(name, None)
            if value is not None:
                data[target] = int(value * 10**9)
        if not data.get("queue"):
            data.pop("queue", None)
        return data


def parse_flags(text: str) -> dict[str, Any]:
    """Engine flags as written by an admin: a JSON object, or one ``name=value`` per line.

    ``--max-num-seqs 4``, ``max-num-seqs=4`` and ``enable-prefix-caching`` (true) all work.
    Values are only shaped here (numbers, true/false); the deployments service checks them
    against the allow-list.
    """
    text = (text or "").strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise forms.ValidationError(f"Not valid JSON: {exc.msg} (line {exc.lineno}).") from None
        if not isinstance(value, dict):
            raise forms.ValidationError("Give a JSON object or one flag per line.")
        return value
    flags: dict[str, Any] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, raw = line.partition("=") if "=" in line else line.partition(" ")
        flags[name.strip().removeprefix("--")] = _scalar(raw.strip()) if raw.strip() else True
    return flags


def _scalar(raw: str) -> Any:
    lowered = raw.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


# An on-demand timeout longer than a day is a typing mistake, not a setting.
MAX_TIMEOUT_SECONDS = 24 * 3600


class DemandForm(forms.Form):
    """When a deployment's engines run: always, or on demand with its two timeouts (an empty
    field is the model's default)."""

    mode = forms.ChoiceField(
        choices=DeploymentMode.choices,
        initial=DeploymentMode.ALWAYS,
        required=False,
        help_text="On demand: not started until a request asks for it, stopped again after "
        "its idle timeout, so more models than memory can take turns on a node.",
    )
    idle_timeout_seconds = forms.IntegerField(
        min_value=10,
        max_value=MAX_TIMEOUT_SECONDS,
        initial=900,
        required=False,
        label="Idle timeout (seconds)",
        help_text="On demand: unused this long, its engines are stopped and their memory "
        "freed (900 s = 15 min).",
    )
    start_timeout_seconds = forms.IntegerField(
        min_value=10,
        max_value=MAX_TIMEOUT_SECONDS,
        initial=600,
        required=False,
        label="Start timeout (seconds)",
        help_text="On demand: how long a request waits for the engine to start before it is "
        "answered 503 with Retry-After (600 s = 10 min).",
    )

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        for name in DemandForm.base_fields:
            if cleaned.get(name) in (None, "") and name not in self.errors:
                cleaned[name] = Deployment._meta.get_field(name).default
        return cleaned

    def service_data(self) -> dict[str, Any]:
        return dict(self.cleaned_data)


class DeploymentForm(DemandForm):
    """A new deployment: what runs where (and, from DemandForm, when)."""

    field_order = [
        "name",
        "model",
        "node",
        "profile",
        "image",
        "engine_args",
        "env",
        "replicas",
        "cpus",
    ]

    name = forms.SlugField(
        max_length=64, help_text="Letters, digits and hyphens, e.g. qwen3-8b-main."
    )
    model = forms.ModelChoiceField(queryset=CatalogModel.objects.all())
    node = forms.ModelChoiceField(
        queryset=Node.objects.all(),
        required=False,
        help_text="Empty: the node with the most free memory.",
    )
    profile = forms.ModelChoiceField(
        queryset=EngineProfile.objects.all(),
        required=False,
        help_text="Known-good defaults (image, flags); your flags override them.",
    )
    image = forms.CharField(
        required=False,
        max_length=255,
        help_text="Empty: the profile's image. Must match the allowed images.",
    )
    engine_args = forms.CharField(
        required=False,
        widget=forms.Textarea(
            attrs={"rows": 4, "class": "mono", "placeholder": "max-num-seqs=4\nmax-model-len=32k"}
        ),
        label="Engine flags",
        help_text="One vllm serve flag per line (name=value), or a JSON object. "
        "Only allow-listed flags are accepted.",
    )
    env = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 2, "class": "mono"}),
        label="Engine environment",
        help_text="NAME=value per line; allow-listed names only (VLLM_*, NCCL_*, …).",
    )
    replicas = forms.IntegerField(min_value=1, max_value=16, initial=1, label="Replicas (engines)")
    cpus = forms.DecimalField(
        required=False,
        min_value=Decimal("0.1"),
        max_digits=6,
        decimal_places=2,
        label="CPU cores per engine",
        help_text="Docker's --cpus, e.g. 1.5. Empty: the node's cores minus the profile's CPU "
        "headroom (the cpu profile leaves half a core to Tollgate), or no limit.",
    )

    def clean_engine_args(self) -> dict[str, Any]:
        return parse_flags(self.cleaned_data.get("engine_args", ""))

    def clean_env(self) -> dict[str, str]:
        return {k: str(v) for k, v in parse_flags(self.cleaned_data.get("env", "")).items()}


class ScaleForm(forms.Form):
    replicas = forms.IntegerField(min_value=1, max_value=16, label="Replicas")


class UsageFilterForm(forms.Form):
    start = forms.DateField(
        required=False, widget=forms.DateInput(attrs={"type": "date"}), label="From (UTC)"
    )
    end = forms.DateField(
        required=False, widget=forms.DateInput(attrs={"type": "date"}), label="To (UTC, inclusive)"
    )
    tenant = forms.ModelChoiceField(
        queryset=Tenant.objects.none(),
        required=False,
        to_field_name="slug",
        empty_label="All tenants",
    )
    model = forms.ModelChoiceField(
        queryset=CatalogModel.objects.none(),
        required=False,
        to_field_name="served_name",
        empty_label="All models",
    )
    adapter = forms.ModelChoiceField(
        queryset=Adapter.objects.none(),
        required=False,
        to_field_name="served_name",
        empty_label="All adapters",
        label="LoRA adapter",
    )
    key = forms.CharField(required=False, max_length=16, label="Key prefix")
    group = forms.ChoiceField(
        choices=[("tenant", "Tenant"), ("model", "Model & adapter")],
        required=False,
        label="Chart by",
    )
    granularity = forms.ChoiceField(choices=[("day", "Day"), ("hour", "Hour")], required=False)

    def __init__(
        self, *args: Any, tenants: Any, models: Any, adapters: Any = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.fields["tenant"].queryset = tenants
        self.fields["model"].queryset = models
        if adapters is not None:
            self.fields["adapter"].queryset = adapters


class JoinNodeForm(forms.Form):
    node_name = forms.CharField(
        max_length=63,
        label="New node's name",
        help_text="Lower-case letters, digits and -, e.g. spark-2.",
    )
    control_plane = forms.CharField(
        max_length=255,
        required=False,
        label="Control plane URL",
        help_text=(
            "The URL the new box reaches this console at on the private link, e.g. "
            "http://192.168.100.10 (its Redis is reached on the same host)."
        ),
    )


# --- People, profile ----------------------------------------------------------------------

ROLE_HELP = "Tenant admins manage the tenant's keys, members and usage; members use it."


class InviteForm(forms.Form):
    """A new console user; the one-time password is made by the service and shown once."""

    username = forms.CharField(max_length=150, help_text="What they log in with.")
    email = forms.EmailField(required=False)
    tenant = forms.ModelChoiceField(
        queryset=Tenant.objects.none(),
        required=False,
        to_field_name="slug",
        empty_label="No tenant yet",
    )
    role = forms.ChoiceField(choices=Role.choices, initial=Role.MEMBER, help_text=ROLE_HELP)
    is_staff = forms.BooleanField(
        required=False, label="Platform admin", help_text="Sees and manages everything."
    )

    def __init__(self, *args: Any, tenants: Any = None, staff: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if tenants is None:
            # Inviting into one tenant (its members page): the tenant is the page's.
            del self.fields["tenant"]
        else:
            self.fields["tenant"].queryset = tenants
        if not staff:
            del self.fields["is_staff"]


class MembershipForm(forms.Form):
    tenant = forms.ModelChoiceField(queryset=Tenant.objects.all(), to_field_name="slug")
    role = forms.ChoiceField(choices=Role.choices, initial=Role.MEMBER, help_text=ROLE_HELP)


TOKEN_LIFETIMES = [("30", "30 days"), ("90", "90 days"), ("365", "1 year"), ("", "Never")]


class AdminTokenForm(forms.Form):
    name = forms.CharField(max_length=100, help_text="What it is for, e.g. “CI” or “laptop”.")
    lifetime = forms.ChoiceField(
        choices=TOKEN_LIFETIMES,
        initial="90",
        required=False,
        label="Expires after",
        help_text="A token that never expires lives until you revoke it.",
    )

    def service_data(self) -> dict[str, Any]:
        days = self.cleaned_data.get("lifetime")
        expires_at = timezone.now() + timedelta(days=int(days)) if days else None
        return {"name": self.cleaned_data["name"], "expires_at": expires_at}


class WebhookForm(forms.Form):
    """A webhook endpoint: where, which events, and (when made) for which tenant."""

    tenant = forms.ModelChoiceField(
        queryset=Tenant.objects.none(),
        required=False,
        empty_label="— Platform (no tenant) —",
        help_text="A tenant's endpoint receives that tenant's events; a platform endpoint the "
        "platform's, and every tenant's budget events if it subscribes to them.",
    )
    url = forms.CharField(
        max_length=2000,
        label="URL",
        help_text="http:// or https://, no credentials in it; internal addresses are fine. "
        "Tollgate POSTs signed JSON here (docs: Admins › Alerts, notices and webhooks).",
    )
    description = forms.CharField(max_length=200, required=False)
    events = forms.MultipleChoiceField(
        choices=[(e.value, f"{e.value} — {e.label}") for e in SUBSCRIBABLE],
        widget=forms.CheckboxSelectMultiple,
        help_text="Platform endpoints only: engine.drift.",
    )
    enabled = forms.BooleanField(required=False, initial=True, help_text="Off: nothing is sent.")

    def __init__(
        self, *args: Any, tenants: Any, platform: bool, editing: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        tenant_field = self.fields["tenant"]
        tenant_field.queryset = tenants
        tenant_field.required = not platform
        if not platform:
            tenant_field.empty_label = None
        if editing:
            del self.fields["tenant"]
        if not self.is_bound and not editing:
            self.initial.setdefault("events", [Event.BUDGET_THRESHOLD.value])

    def service_data(self) -> dict[str, Any]:
        data = dict(self.cleaned_data)
        data.pop("tenant", None)
        return data
