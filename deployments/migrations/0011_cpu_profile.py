"""The built-in ``cpu`` profile: real vLLM without a GPU (tollgate/vllm-cpu)."""

from django.db import migrations


def add_cpu_profile(apps, schema_editor):
    from deployments.profiles import BUILTIN_PROFILES

    EngineProfile = apps.get_model("deployments", "EngineProfile")
    known = {f.name for f in EngineProfile._meta.get_fields()}
    for profile in BUILTIN_PROFILES:
        if profile["name"] == "cpu":
            fields = {k: v for k, v in profile.items() if k in known}
            EngineProfile.objects.update_or_create(
                name="cpu", defaults={**fields, "builtin": True}
            )


class Migration(migrations.Migration):
    dependencies = [("deployments", "0010_node_credentials")]
    operations = [migrations.RunPython(add_cpu_profile, migrations.RunPython.noop)]
