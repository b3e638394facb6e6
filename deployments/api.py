"""Admin API views for the model catalogue, LoRA adapters, nodes, deployments and operations."""

from typing import Any

import django_filters
from django.contrib.auth.models import AnonymousUser
from django.db.models import Q, QuerySet
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import extend_schema
from rest_framework import status, viewsets
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.permissions import SAFE_METHODS, BasePermission
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import BaseSerializer

from core.api import AdminViewSetMixin, UserScopedMixin
from deployments import access, adapter_uploads, adapters, credentials, joining, services, staging
from deployments.choices import DesiredState
from deployments.models import (
    Adapter,
    AdapterGrant,
    AllowedImage,
    CatalogModel,
    Deployment,
    EngineProfile,
    ModelGrant,
    Node,
    Operation,
    StagedModel,
)
from deployments.serializers import (
    AdapterArchiveSerializer,
    AdapterSerializer,
    AllowedImageSerializer,
    CatalogModelSerializer,
    DeploymentSerializer,
    EngineProfileSerializer,
    GrantSerializer,
    JoinTokenRequestSerializer,
    JoinTokenSerializer,
    LogsQuerySerializer,
    LogsSerializer,
    MemoryFitSerializer,
    NodeCredentialSerializer,
    NodeJoinSerializer,
    NodeSerializer,
    OperationSerializer,
    StagedModelSerializer,
    StageSerializer,
)
from tenants.access import admin_tenant_ids, member_tenant_ids
from tenants.permissions import IsPlatformAdmin, PlatformAdminWrites, TenantAdminWrites


class CatalogModelViewSet(AdminViewSetMixin, UserScopedMixin, viewsets.ModelViewSet):
    """The model catalogue. Tenant users see the models they may call; admins manage it."""

    serializer_class = CatalogModelSerializer
    permission_classes = [PlatformAdminWrites]
    filterset_fields = ["task", "visibility", "served_name"]
    lookup_field = "served_name"
    # Served names may hold one slash (``Qwen/Qwen3-8B``); actions are matched first.
    lookup_value_regex = r"[^/]+/[^/]+|[^/]+"
    legacy_pk_lookup = True

    queryset = CatalogModel.objects.none()

    def scope(self, user: object) -> QuerySet[CatalogModel]:
        return access.models_visible_to(user).prefetch_related("granted_tenants")

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
    def grant(self, request: Request, served_name: str) -> Response:
        """Let a tenant use this (private) model."""
        model = self.get_object()
        body = GrantSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        services.grant_model(request.user, model, body.validated_data["tenant"])
        return Response(self.get_serializer(self.get_object()).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=GrantSerializer, responses=CatalogModelSerializer)
    @action(detail=True, methods=["post"])
    def ungrant(self, request: Request, served_name: str) -> Response:
        """Take this model away from a tenant it was granted to."""
        model = self.get_object()
        body = GrantSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        grant = get_object_or_404(ModelGrant, model=model, tenant=body.validated_data["tenant"])
        services.revoke_grant(request.user, grant)
        return Response(self.get_serializer(self.get_object()).data)

    @extend_schema(request=StageSerializer, responses={202: OperationSerializer})
    @action(detail=True, methods=["post"], permission_classes=[IsPlatformAdmin])
    def stage(self, request: Request, served_name: str) -> Response:
        """Download this model's weights into a node's model cache before deploying it."""
        body = StageSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        op = staging.stage_weights(
            request.user,
            self.get_object(),
            body.validated_data["node"],
            body.validated_data["image"],
        )
        return Response(OperationSerializer(op).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(responses=StagedModelSerializer(many=True))
    @action(detail=False, methods=["get"], permission_classes=[IsPlatformAdmin])
    def staged(self, request: Request) -> Response:
        """Models whose weights are in a node's cache, with their size on disk."""
        rows = StagedModel.objects.select_related("model", "node").order_by("model", "node")
        return self.paginated(rows, StagedModelSerializer)


class AdapterFilter(django_filters.FilterSet):
    """``?tenant__slug=`` finds only adapters whose owner the caller may know: a tenant that
    was only shared an adapter cannot learn whose it is by filtering."""

    tenant__slug = django_filters.CharFilter(method="by_owner", label="Owner tenant's slug")

    class Meta:
        model = Adapter
        fields = ["status", "visibility", "pinned", "base__served_name"]

    def by_owner(self, rows: QuerySet[Adapter], name: str, value: str) -> QuerySet[Adapter]:
        rows = rows.filter(tenant__slug=value)
        user = self.request.user
        return rows if user.is_staff else rows.filter(tenant_id__in=member_tenant_ids(user))


class AdapterWrites(TenantAdminWrites):
    """Members read; tenant admins register adapters and change their own tenant's (another
    tenant's private adapter is not in their list: 404 before any 403)."""

    message = "Only the admins of the adapter's tenant can change it."

    def has_permission(self, request: Request, view: Any) -> bool:
        if not super().has_permission(request, view):
            return False
        if request.method in SAFE_METHODS or getattr(view, "detail", False):
            return True
        if request.user.is_staff or admin_tenant_ids(request.user):
            return True
        self.message = "Only tenant admins can register adapters."
        return False


class AdapterViewSet(AdminViewSetMixin, UserScopedMixin, viewsets.ModelViewSet):
    """LoRA adapters on a base model. Platform admins manage all; a tenant's admins manage
    its own; members read the adapters their tenant may call."""

    serializer_class = AdapterSerializer
    permission_classes = [AdapterWrites]
    filterset_class = AdapterFilter
    lookup_field = "served_name"
    # A served name may hold one slash (``acme/support-v3``); actions are matched first.
    lookup_value_regex = r"[^/]+/[^/]+|[^/]+"
    legacy_pk_lookup = True
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]
    bodyless_actions = AdminViewSetMixin.bodyless_actions | {"check"}

    queryset = Adapter.objects.none()

    def scope(self, user: Any) -> QuerySet[Adapter]:
        rows = Adapter.objects.select_related("base", "tenant").prefetch_related("granted_tenants")
        if user.is_staff:
            return rows
        # Their tenant's adapters stay in a tenant admin's list when the base went out of
        # their reach, so they can fix or delete them; the rest is what their tenants may call.
        callable_ = access.adapters_visible_to(user).values("pk")
        return rows.filter(Q(tenant_id__in=admin_tenant_ids(user)) | Q(pk__in=callable_))

    def initial(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super().initial(request, *args, **kwargs)
        if self.action in ("create", "upload"):  # before a too large body is parsed
            adapter_uploads.check_request_size(request.META.get("CONTENT_LENGTH"))
            # A chunked body has no length: parse it now, and refuse it in the archive's
            # words if its file was cut off while read (not "no file was submitted").
            _ = request.data
            adapter_uploads.check_not_cut_off(request)

    def perform_create(self, serializer: BaseSerializer) -> None:
        fields = dict(serializer.validated_data)
        archive = fields.pop("archive", None)
        if archive is not None:
            adapter = adapter_uploads.create_uploaded_adapter(self.request.user, archive, **fields)
        else:
            adapter = adapters.create_adapter(self.request.user, **fields)
        adapter.refresh_from_db()  # the queued check may have said already why it waits
        serializer.instance = adapter

    def perform_update(self, serializer: BaseSerializer) -> None:
        fields, adapter = serializer.validated_data, serializer.instance
        adapter = adapters.update_adapter(self.request.user, adapter, **fields)
        adapter.refresh_from_db()
        serializer.instance = adapter

    def perform_destroy(self, instance: Adapter) -> None:
        adapters.delete_adapter(self.request.user, instance)

    @extend_schema(request=GrantSerializer, responses={201: AdapterSerializer})
    @action(detail=True, methods=["post"])
    def grant(self, request: Request, served_name: str) -> Response:
        """Let one more tenant call this private adapter (platform admins)."""
        adapter = self._to_share()
        body = GrantSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        adapters.grant_adapter(request.user, adapter, body.validated_data["tenant"])
        return Response(self.get_serializer(self.get_object()).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=GrantSerializer, responses=AdapterSerializer)
    @action(detail=True, methods=["post"])
    def ungrant(self, request: Request, served_name: str) -> Response:
        """Take this adapter away from a tenant it was granted to (platform admins)."""
        adapter = self._to_share()
        body = GrantSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        tenant = body.validated_data["tenant"]
        grant = get_object_or_404(AdapterGrant, adapter=adapter, tenant=tenant)
        adapters.revoke_adapter_grant(request.user, grant)
        return Response(self.get_serializer(self.get_object()).data)

    @extend_schema(request=None, responses={202: AdapterSerializer})
    @action(detail=True, methods=["post"])
    def check(self, request: Request, served_name: str) -> Response:
        """Check the adapter's files again (after a failed check, once they were fixed)."""
        adapters.check_again(request.user, self.get_object())
        return Response(
            self.get_serializer(self.get_object()).data, status=status.HTTP_202_ACCEPTED
        )

    @extend_schema(
        request={"multipart/form-data": AdapterArchiveSerializer},
        responses={202: AdapterSerializer},
    )
    @action(detail=True, methods=["post"])
    def upload(self, request: Request, served_name: str) -> Response:
        """Replace the adapter's files with an uploaded archive (.tar, .tar.gz or .zip),
        checked before it is accepted; then they are checked again on every node."""
        adapter = self.get_object()  # 404 for another tenant's, 403 for a mere member
        body = AdapterArchiveSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        adapter_uploads.replace_adapter_files(request.user, adapter, body.validated_data["archive"])
        return Response(
            self.get_serializer(self.get_object()).data, status=status.HTTP_202_ACCEPTED
        )

    def _to_share(self) -> Adapter:
        adapter = self.get_object()  # 404 for another tenant's, before the 403 below
        if not adapters.may_share(self.request.user):
            raise PermissionDenied(adapters.NOT_YOURS_TO_SHARE)
        return adapter


class JoinTokenAuthentication(BaseAuthentication):
    """``Authorization: Bearer tgj-…``: a node agent joining. The token is checked (and
    spent) by ``joining.exchange_join_token``; here it is only carried to the view."""

    def authenticate(self, request: Request) -> tuple[AnonymousUser, str] | None:
        scheme, _, token = get_authorization_header(request).decode(errors="replace").partition(" ")
        if scheme.lower() != "bearer" or not token.startswith(f"{joining.KIND}-"):
            return None
        return AnonymousUser(), token.strip()

    def authenticate_header(self, request: Request) -> str:
        return "Bearer"


class HasJoinToken(BasePermission):
    def has_permission(self, request: Request, view: object) -> bool:
        return isinstance(request.auth, str)


class NodeViewSet(AdminViewSetMixin, viewsets.ModelViewSet):
    """Docker hosts that run engines. Platform admins only."""

    serializer_class = NodeSerializer
    permission_classes = [IsPlatformAdmin]
    queryset = Node.objects.all()
    filterset_fields = ["status", "arch"]
    lookup_field = "name"
    legacy_pk_lookup = True

    def perform_create(self, serializer: BaseSerializer) -> None:
        serializer.instance = services.register_node(self.request.user, **serializer.validated_data)

    def perform_update(self, serializer: BaseSerializer) -> None:
        serializer.instance = services.update_node(
            self.request.user, serializer.instance, **serializer.validated_data
        )

    def perform_destroy(self, instance: Node) -> None:
        services.delete_node(self.request.user, instance)

    @extend_schema(request=JoinTokenRequestSerializer, responses={201: JoinTokenSerializer})
    @action(detail=False, methods=["post"], url_path="join-token")
    def join_token(self, request: Request) -> Response:
        """A one-time token and the command that makes a new box join as the named node."""
        body = JoinTokenRequestSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        issued = joining.create_join_token(request.user, **body.validated_data)
        data = {
            "node_name": issued.node_name,
            "token": issued.token,
            "expires_at": issued.expires_at,
            "command": issued.command,
        }
        return Response(JoinTokenSerializer(data).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=NodeJoinSerializer, responses={201: NodeCredentialSerializer})
    @action(
        detail=False,
        methods=["post"],
        permission_classes=[HasJoinToken],
        authentication_classes=[JoinTokenAuthentication],
    )
    def join(self, request: Request) -> Response:
        """A node agent spends its one-time join token (``Authorization: Bearer tgj-…``)
        for the node's own credential."""
        body = NodeJoinSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        fields = dict(body.validated_data)
        joined = joining.exchange_join_token(request.auth, fields.pop("name"), **fields)
        data = {
            "name": joined.node.name,
            "redis_user": joined.redis_user,
            "redis_password": joined.redis_password,
            "key_base": joined.key_base,
        }
        return Response(NodeCredentialSerializer(data).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses=NodeSerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, name: str) -> Response:
        """Cut a joined node off: its credential stops working and its replicas leave routing."""
        node = credentials.revoke_node(request.user, self.get_object())
        return Response(self.get_serializer(node).data)


class DeploymentViewSet(AdminViewSetMixin, viewsets.ModelViewSet):
    """What should run where. Platform admins only."""

    serializer_class = DeploymentSerializer
    permission_classes = [IsPlatformAdmin]
    queryset = Deployment.objects.select_related("model", "node").prefetch_related(
        "replica_set__node"
    )
    filterset_fields = ["state", "desired_state", "mode", "node__name", "model__served_name"]
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

    @extend_schema(request=None, responses={202: OperationSerializer})
    @action(detail=True, methods=["post"])
    def restart(self, request: Request, name: str) -> Response:
        """Replace every replica, one after the other (drained first)."""
        op = services.restart_deployment(request.user, self.get_object())
        return Response(OperationSerializer(op).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(request=None, responses={202: OperationSerializer, 204: None})
    @action(detail=True, methods=["post"])
    def remove(self, request: Request, name: str) -> Response:
        """Drain and stop the replicas, then remove the deployment."""
        op = services.remove_deployment(request.user, self.get_object())
        if op is None:
            return Response(status=status.HTTP_204_NO_CONTENT)
        return Response(OperationSerializer(op).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(parameters=[LogsQuerySerializer], responses=LogsSerializer)
    @action(detail=True, methods=["get"])
    def logs(self, request: Request, name: str) -> Response:
        """The last lines of a replica's engine log: ``?replica=0&lines=200``."""
        deployment = self.get_object()
        query = LogsQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        index, lines = query.validated_data["replica"], query.validated_data["lines"]
        text = services.replica_logs(deployment, index, lines)
        return Response({"replica": index, "lines": lines, "log": text})

    @extend_schema(responses=OperationSerializer(many=True))
    @action(detail=True, methods=["get"])
    def operations(self, request: Request, name: str) -> Response:
        """This deployment's operations, newest first."""
        return self.paginated(self.get_object().operations.order_by("-id"), OperationSerializer)

    @extend_schema(request=None, responses=MemoryFitSerializer)
    @action(detail=True, methods=["get"], url_path="memory-fit")
    def memory_fit(self, request: Request, name: str) -> Response:
        """The memory-fit arithmetic for this deployment on its node."""
        verdict = services.memory_fit(self.get_object())
        if verdict is None:
            return Response({"fits": True, "message": "Nothing to check."})
        return Response({"fits": verdict.fits, "message": verdict.message})

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


class OperationViewSet(AdminViewSetMixin, viewsets.ReadOnlyModelViewSet):
    """Long-running actions and their progress. Platform admins only."""

    serializer_class = OperationSerializer
    permission_classes = [IsPlatformAdmin]
    queryset = Operation.objects.select_related("deployment", "node", "model")
    filterset_fields = ["kind", "status", "deployment__name"]


class EngineProfileViewSet(AdminViewSetMixin, viewsets.ModelViewSet):
    """Engine profiles (known-good image, flags and environment). Platform admins only."""

    serializer_class = EngineProfileSerializer
    permission_classes = [IsPlatformAdmin]
    queryset = EngineProfile.objects.all()
    lookup_field = "name"

    def perform_create(self, serializer: BaseSerializer) -> None:
        serializer.instance = services.save_profile(
            self.request.user, EngineProfile(), **serializer.validated_data
        )

    def perform_update(self, serializer: BaseSerializer) -> None:
        serializer.instance = services.save_profile(
            self.request.user, serializer.instance, **serializer.validated_data
        )

    def perform_destroy(self, instance: EngineProfile) -> None:
        services.delete_profile(self.request.user, instance)


class AllowedImageViewSet(AdminViewSetMixin, viewsets.ModelViewSet):
    """Engine image patterns allowed in addition to TOLLGATE_ENGINE_IMAGES. Platform admins."""

    serializer_class = AllowedImageSerializer
    permission_classes = [IsPlatformAdmin]
    queryset = AllowedImage.objects.all()
    http_method_names = ["get", "post", "delete", "head", "options"]

    def perform_create(self, serializer: BaseSerializer) -> None:
        serializer.instance = services.allow_image(self.request.user, **serializer.validated_data)

    def perform_destroy(self, instance: AllowedImage) -> None:
        services.disallow_image(self.request.user, instance)
