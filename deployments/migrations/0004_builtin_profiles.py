from django.db import migrations


def create_builtin_profiles(apps, schema_editor):
    from deployments.profiles import BUILTIN_PROFILES

    EngineProfile = apps.get_model("deployments", "EngineProfile")
    for profile in BUILTIN_PROFILES:
        EngineProfile.objects.update_or_create(
            name=profile["name"], defaults={**profile, "builtin": True}
        )


class Migration(migrations.Migration):

    dependencies = [("deployments", "0003_closing_adjustments_reconcile")]

    operations = [migrations.RunPython(create_builtin_profiles, migrations.RunPython.noop)]
