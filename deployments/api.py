"""Admin API views for the model catalogue, nodes, deployments and operations."""

from django.db.models import QuerySet
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema
from rest_framework import status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import BaseSerializer

from config.api import UserScopedMixin
from config.permissions import IsPlatformAdmin, PlatformAdminWrites, member_tenant_ids
from deployments import services
from deployments.choices import DesiredState
from deployments.models import CatalogModel, Deployment, ModelGrant, Node, Operation
from deployments.serializers import (
    CatalogModelSerializer,
    DeploymentSerializer,
    GrantSerializer,
    NodeSerializer,
    OperationSerializer,
)
from tenants.models import Tenant


def models_visible_to(user: object) -> QuerySet[CatalogModel]:
    """Every model for platform admins; for others, what any of their tenants may call."""
    if user.is_staff:
        return CatalogModel.objects.all()
    ids: set[int] = set()
    for tenant in Tenant.objects.filter(pk__in=member_tenant_ids(user)):
        ids |= set(services.models_for_tenant(tenant).values_list("pk", flat=True))
    return CatalogModel.objects.filter(pk__in=ids)


class CatalogModelViewSet(UserScopedMixin, viewsets.ModelViewSet):
    """The model catalogue. Tenant users see the models they may call; admins manage it."""

    serializer_class = CatalogModelSerializer
    permission_classes = [PlatformAdminWrites]
    filterset_fields = ["task", "visibility", "served_name"]

    queryset = CatalogModel.objects.none()

    def scope(self, user: object) -> QuerySet[CatalogModel]:
        return models_visible_to(user).prefetch_related("granted_tenants")

    def perform_create(self, serializer: BaseSerializer) -> None:
        serializer.instance = services.create_model(self.request.user, **serializer.validated_data)

    def perform_update(self, serializer: BaseSerializer) -> None:
        serializer.instance = services.update_model(
            self.request.user, serializer.instance, **serializer.validated_data
        )

    def perform_destroy(self, instance: CatalogModel) -> None:
        services.delete_model(self.request.user, instance)

    @extend_schema(request=GrantSerializer, responses={201: CatalogModelSerializer})
    @action(detail=True, methods=["post"])
    def grant(self, request: Request, pk: str) -> Response:
        """Let a tenant use this (private) model."""
        model = self.get_object()
        body = GrantSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        services.grant_model(request.user, model, body.validated_data["tenant"])
        return Response(self.get_serializer(model).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=GrantSerializer, responses=CatalogModelSerializer)
    @action(detail=True, methods=["post"])
    def ungrant(self, request: Request, pk: str) -> Response:
        """Take this model away from a tenant it was granted to."""
        model = self.get_object()
        body = GrantSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        grant = get_object_or_404(ModelGrant, model=model, tenant=body.validated_data["tenant"])
        services.revoke_grant(request.user, grant)
        return Response(self.get_serializer(model).data)


class NodeViewSet(viewsets.ModelViewSet):
    """Docker hosts that run engines. Platform admins only."""

    serializer_class = NodeSerializer
    permission_classes = [IsPlatformAdmin]
    queryset = Node.objects.all()
    filterset_fields = ["status", "arch"]

    def perform_create(self, serializer: BaseSerializer) -> None:
        serializer.instance = services.register_node(self.request.user, **serializer.validated_data)

    def perform_update(self, serializer: BaseSerializer) -> None:
        serializer.instance = services.update_node(
            self.request.user, serializer.instance, **serializer.validated_data
        )

    def perform_destroy(self, instance: Node) -> None:
        services.delete_node(self.request.user, instance)


class DeploymentViewSet(viewsets.ModelViewSet):
    """What should run where. Platform admins only."""

    serializer_class = DeploymentSerializer
    permission_classes = [IsPlatformAdmin]
    queryset = Deployment.objects.select_related("model", "node").prefetch_related(
        "replica_set__node"
    )
    filterset_fields = ["state", "desired_state", "node__name", "model__served_name"]
    lookup_field = "name"

    def perform_create(self, serializer: BaseSerializer) -> None:
        serializer.instance = services.create_deployment(
            self.request.user, **serializer.validated_data
        )

    def perform_update(self, serializer: BaseSerializer) -> None:
        serializer.instance = services.update_deployment(
            self.request.user, serializer.instance, **serializer.validated_data
        )

    def perform_destroy(self, instance: Deployment) -> None:
        services.delete_deployment(self.request.user, instance)

    @extend_schema(request=None, responses=DeploymentSerializer)
    @action(detail=True, methods=["post"])
    def start(self, request: Request, name: str) -> Response:
        """Ask for the deployment to run its replicas."""
        deployment = services.set_desired_state(
            request.user, self.get_object(), DesiredState.RUNNING
        )
        return Response(self.get_serializer(deployment).data)

    @extend_schema(request=None, responses=DeploymentSerializer)
    @action(detail=True, methods=["post"])
    def stop(self, request: Request, name: str) -> Response:
        """Ask for the deployment to drain and stop."""
        deployment = services.set_desired_state(
            request.user, self.get_object(), DesiredState.STOPPED
        )
        return Response(self.get_serializer(deployment).data)


class OperationViewSet(viewsets.ReadOnlyModelViewSet):
    """Long-running actions and their progress. Platform admins only."""

    serializer_class = OperationSerializer
    permission_classes = [IsPlatformAdmin]
    queryset = Operation.objects.select_related("deployment", "node", "model")
    filterset_fields = ["kind", "status", "deployment__name"]
