from django.db import migrations


def create_builtin_profiles(apps, schema_editor):
    from deployments.profiles import BUILTIN_PROFILES

    EngineProfile = apps.get_model("deployments", "EngineProfile")
    # Only the fields this migration's model has (later ones fill in the rest).
    known = {f.name for f in EngineProfile._meta.get_fields()}
    for profile in BUILTIN_PROFILES:
        fields = {k: v for k, v in profile.items() if k in known}
        EngineProfile.objects.update_or_create(
            name=profile["name"], defaults={**fields, "builtin": True}
        )


class Migration(migrations.Migration):

    dependencies = [("deployments", "0003_closing_adjustments_reconcile")]

    operations = [migrations.RunPython(create_builtin_profiles, migrations.RunPython.noop)]
