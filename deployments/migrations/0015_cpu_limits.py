"""CPU limits for engine containers: a deployment's own, or its profile's headroom."""

from decimal import Decimal

import django.core.validators
from django.db import migrations, models


def leave_half_a_core(apps, schema_editor):
    """The built-in cpu profile leaves half a core to Tollgate (see deployments.profiles)."""
    EngineProfile = apps.get_model("deployments", "EngineProfile")
    EngineProfile.objects.filter(name="cpu", builtin=True).update(cpu_headroom=Decimal("0.5"))


class Migration(migrations.Migration):
    dependencies = [("deployments", "0014_model_allowed_request_fields")]

    operations = [
        migrations.AddField(
            model_name="deployment",
            name="cpus",
            field=models.DecimalField(
                blank=True,
                decimal_places=2,
                help_text="CPU cores each engine container may use (Docker's --cpus). Empty: "
                "the node's cores minus the profile's CPU headroom, or no limit.",
                max_digits=6,
                null=True,
                validators=[django.core.validators.MinValueValidator(Decimal("0.1"))],
            ),
        ),
        migrations.AddField(
            model_name="engineprofile",
            name="cpu_headroom",
            field=models.DecimalField(
                blank=True,
                decimal_places=2,
                help_text="CPU cores kept free on the engine's node for Tollgate and the host: "
                "an engine may use the node's cores minus this (Docker's --cpus). Empty: no "
                "limit.",
                max_digits=5,
                null=True,
                validators=[django.core.validators.MinValueValidator(Decimal("0"))],
            ),
        ),
        migrations.RunPython(leave_half_a_core, migrations.RunPython.noop),
    ]
