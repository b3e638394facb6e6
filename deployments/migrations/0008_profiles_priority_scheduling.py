"""Built-in engine profiles schedule by priority (vLLM --scheduling-policy priority)."""

from django.db import migrations


def add_priority_scheduling(apps, schema_editor):
    EngineProfile = apps.get_model("deployments", "EngineProfile")
    for profile in EngineProfile.objects.filter(builtin=True, name__in=["dgx-spark", "simulator"]):
        if "scheduling-policy" not in profile.engine_args:
            profile.engine_args = {**profile.engine_args, "scheduling-policy": "priority"}
            profile.save(update_fields=["engine_args"])


class Migration(migrations.Migration):
    dependencies = [("deployments", "0007_node_memory_limit")]
    operations = [migrations.RunPython(add_priority_scheduling, migrations.RunPython.noop)]
