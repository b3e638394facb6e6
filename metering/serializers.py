"""Admin API representations of prices and usage."""

from typing import Any

from rest_framework import serializers

from core.api import ModelSerializer, Serializer
from deployments.models import Adapter, CatalogModel
from metering.models import PRICE_FIELDS, Price, UsageEvent


class PriceSerializer(ModelSerializer):
    model = serializers.SlugRelatedField(
        slug_field="served_name",
        queryset=CatalogModel.objects.all(),
        required=False,
        help_text="The base model; for an adapter's price it may be left out.",
    )
    adapter = serializers.SlugRelatedField(
        slug_field="served_name",
        queryset=Adapter.objects.all(),
        required=False,
        allow_null=True,
        help_text="A LoRA adapter's served name: the price is the adapter's own.",
    )
    cached_input_per_mtok = serializers.DecimalField(
        max_digits=14,
        decimal_places=6,
        min_value=0,
        required=False,
        help_text="Defaults to the input price.",
    )
    effective_from = serializers.DateTimeField(
        required=False, help_text="Defaults to now; never in the past."
    )

    class Meta:
        model = Price
        fields = ["id", *PRICE_FIELDS, "created_at"]
        read_only_fields = ["created_at"]
        validators = []  # uniqueness is checked by the service with a readable message

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        adapter = attrs.get("adapter")
        if adapter is not None:
            attrs.setdefault("model", adapter.base)
        if "model" not in attrs:
            raise serializers.ValidationError({"model": "Name a model or an adapter."})
        return attrs


class UsageEventSerializer(ModelSerializer):
    tenant = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    api_key = serializers.SlugRelatedField(slug_field="prefix", read_only=True, allow_null=True)
    model = serializers.SlugRelatedField(slug_field="served_name", read_only=True)
    adapter = serializers.SlugRelatedField(
        slug_field="served_name", read_only=True, allow_null=True
    )
    deployment = serializers.SlugRelatedField(slug_field="name", read_only=True, allow_null=True)

    class Meta:
        model = UsageEvent
        fields = [
            "request_id",
            "occurred_at",
            "tenant",
            "api_key",
            "model",
            "adapter",
            "deployment",
            "endpoint",
            "priority",
            "prompt_tokens",
            "cached_tokens",
            "completion_tokens",
            "reasoning_tokens",
            "prompt_estimated",
            "status",
            "http_status",
            "latency_ms",
            "ttft_ms",
            "start_wait_ms",
            "currency",
            "input_per_mtok",
            "cached_input_per_mtok",
            "output_per_mtok",
            "cost",
        ]
        read_only_fields = fields


class QuotaForecastSerializer(Serializer):
    """One quota's (or budget's) forecast (metering.forecast.Forecast.as_dict)."""

    quota = serializers.ChoiceField(choices=["money", "tokens"])
    unit = serializers.CharField(help_text="The currency's ISO code, or 'tokens'.")
    state = serializers.ChoiceField(
        choices=["runs_out", "not_this_period", "no_usage", "exhausted"]
    )
    runs_out_at = serializers.DateTimeField(
        allow_null=True, help_text="With state runs_out: when, at the last 24 h's rate."
    )
    limit = serializers.CharField(help_text="Money as a decimal string; tokens as an integer.")
    used = serializers.CharField()
    remaining = serializers.CharField()
    rate_per_day = serializers.CharField(help_text="Used in the last 24 h.")
    window_hours = serializers.IntegerField()
    period_id = serializers.CharField()
    period_end = serializers.DateTimeField()
    summary = serializers.CharField()


class ForecastSerializer(Serializer):
    """A tenant's (or key's) forecasts, one per quota (or budget) it has."""

    tenant = serializers.CharField()
    key = serializers.DictField(allow_null=True)
    at = serializers.DateTimeField()
    window_hours = serializers.IntegerField()
    forecasts = QuotaForecastSerializer(many=True)


class BillCheckSerializer(Serializer):
    """The bill checked against a deployment's engines (metering/bill_check.py): per
    replica over the window, and per replica and hour."""

    deployment = serializers.CharField()
    hours = serializers.IntegerField()
    since = serializers.DateTimeField()
    replicas = serializers.ListField(child=serializers.DictField())
    by_hour = serializers.ListField(child=serializers.DictField())
