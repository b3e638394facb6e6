"""The rules of deployments/services.py: which models a tenant may call, desired state,
the image allow-list; against PostgreSQL and Redis."""

import pytest
from django.core.exceptions import ValidationError

from deployments import services as deployment_services
from deployments.choices import DesiredState
from deployments.models import CatalogModel, Node
from tenants import services
from tenants.choices import ModelAccess
from tenants.models import AuditLog, Tenant

pytestmark = pytest.mark.django_db


def test_model_access_public_granted_listed_and_per_key(
    tenant_a: Tenant, tenant_b: Tenant, public_model: CatalogModel, private_model_a: CatalogModel
) -> None:
    from deployments.access import models_for_key, models_for_tenant

    assert set(models_for_tenant(tenant_a)) == {public_model, private_model_a}
    assert set(models_for_tenant(tenant_b)) == {public_model}
    services.update_tenant(
        None, tenant_a, model_access=ModelAccess.LISTED, allowed_models=[private_model_a]
    )
    assert set(models_for_tenant(tenant_a)) == {private_model_a}
    services.update_tenant(None, tenant_a, model_access=ModelAccess.ALL)
    key = services.issue_api_key(None, tenant_a, name="narrow", allowed_models=[public_model]).key
    assert set(models_for_key(key)) == {public_model}
    with pytest.raises(ValidationError, match="Not available to this tenant"):
        services.issue_api_key(None, tenant_b, name="sneaky", allowed_models=[private_model_a])


def test_deployment_desired_state_is_compare_and_set(
    public_model: CatalogModel, local_node: Node
) -> None:
    deployment = deployment_services.create_deployment(
        None,
        name="qwen",
        model=public_model,
        node=local_node,
        image="vllm/vllm-openai:v0.33.0",
        engine_args={"max-num-seqs": "4", "max-model-len": "32k"},
    )
    assert deployment.engine_args == {"max-num-seqs": 4, "max-model-len": 32768}
    assert deployment.max_num_seqs == 4
    deployment_services.set_desired_state(None, deployment, DesiredState.STOPPED)
    deployment_services.set_desired_state(None, deployment, DesiredState.STOPPED)
    assert AuditLog.objects.filter(object_type="deployment", action="action").count() == 1
    with pytest.raises(ValidationError, match="Stop the deployment"):
        deployment.state = "ready"
        deployment.save()
        deployment_services.delete_deployment(None, deployment)


def test_deployment_images_come_only_from_the_allow_list(
    public_model: CatalogModel, local_node: Node
) -> None:
    with pytest.raises(ValidationError) as error:
        deployment_services.create_deployment(
            None, name="evil", model=public_model, node=local_node, image="evil/miner:latest"
        )
    assert "not an allowed engine image" in str(error.value.message_dict["image"])
