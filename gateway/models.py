"""What the admission controller decided, for the console's ceiling history."""

from django.db import models


class AdmissionSample(models.Model):
    """One controller tick for one model: the measured interval and the ceiling it chose."""

    model = models.ForeignKey(
        "deployments.CatalogModel", on_delete=models.CASCADE, related_name="+"
    )
    at = models.DateTimeField(db_index=True)
    budget = models.PositiveIntegerField(help_text="Static budget: the replicas' max_num_seqs.")
    ceiling = models.PositiveIntegerField(help_text="Concurrent requests let into the engines.")
    decision = models.CharField(max_length=16)
    tokens_per_second = models.FloatField()
    ttft_ms = models.FloatField(null=True)
    engine_waiting = models.FloatField(default=0)
    gateway_queued = models.PositiveIntegerField(default=0)
    preemption = models.CharField(
        max_length=16,
        blank=True,
        default="",
        help_text="The verdict on gateway preemption then: frees (an engine slot), frees none "
        "(preemption paused on the model), or blank (not judged).",
    )

    class Meta:
        ordering = ["-at"]

    def __str__(self) -> str:
        return f"{self.model_id} {self.at:%H:%M:%S} ceiling {self.ceiling}"


class StoredResponse(models.Model):
    """One response a tenant asked Tollgate to keep (``store``, the Responses API's default):
    what ``GET /v1/responses/{id}``, ``input_items`` and a later ``previous_response_id``
    need. Written by gateway.response_store's consumer from the gateway's stream."""

    response_id = models.CharField(max_length=64)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="+")
    api_key = models.ForeignKey(
        "tenants.ApiKey", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    model = models.CharField(max_length=200, help_text="The served model name asked for.")
    status = models.CharField(max_length=16)
    created_at = models.DateTimeField(db_index=True)
    previous_response_id = models.CharField(max_length=64, blank=True)
    chain = models.JSONField(
        default=list, help_text="Ids of the earlier responses of the conversation, oldest first."
    )
    input_items = models.JSONField(default=list)
    response = models.JSONField(help_text="The Response object as the client received it.")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["tenant", "response_id"], name="stored_response_unique")
        ]

    def __str__(self) -> str:
        return self.response_id
