"""Tollgate's system checks (config/checks.py) run with Django's own ``manage.py check``.

Run through the check registry, so a check that is not registered fails here too.
"""

import pytest
from django.core.checks import run_checks


def ids(deploy: bool = False) -> set[str]:
    return {message.id for message in run_checks(include_deployment_checks=deploy)}


def test_an_empty_engine_image_list_is_error_e010(settings: object) -> None:
    assert "tollgate.E010" not in ids()
    settings.TOLLGATE_ENGINE_IMAGES = []
    assert "tollgate.E010" in ids()


def test_production_without_a_key_pepper_warns_w002(
    settings: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TOLLGATE_KEY_PEPPER", raising=False)
    monkeypatch.delenv("TOLLGATE_KEY_PEPPER_FILE", raising=False)
    settings.PRODUCTION, settings.TOLLGATE_HTTPS = True, True
    assert "tollgate.W002" in ids(deploy=True)
    monkeypatch.setenv("TOLLGATE_KEY_PEPPER", "pepper")
    assert "tollgate.W002" not in ids(deploy=True)


def test_plain_http_in_production_warns_w001_only_with_deploy_checks(settings: object) -> None:
    settings.PRODUCTION, settings.TOLLGATE_HTTPS = True, False
    assert "tollgate.W001" in ids(deploy=True)
    assert "tollgate.W001" not in ids()
    settings.TOLLGATE_HTTPS = True
    assert "tollgate.W001" not in ids(deploy=True)
