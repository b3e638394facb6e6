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

    class Meta:
        ordering = ["-at"]

    def __str__(self) -> str:
        return f"{self.model_id} {self.at:%H:%M:%S} ceiling {self.ceiling}"
