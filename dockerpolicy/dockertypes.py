"""The request bodies Docker decodes, as Go types (``dockerpolicy.gojson``).

Field names and types follow Docker Engine's API types (moby ``api/types``, API 1.41 to
1.48): the container create body is ``ContainerConfigWrapper`` (``container.Config``
embedded, plus ``HostConfig`` and ``NetworkingConfig``), ``HostConfig`` embeds
``Resources``, and so on. Every field Docker reads is listed, so the policy can name the
field it refuses; a key naming none of them is ignored by Docker and dropped here.
"""

from dockerpolicy.gojson import (
    AnyValue,
    Array,
    Bool,
    EmptyStruct,
    Int,
    Map,
    Ptr,
    Slice,
    String,
    StrSlice,
    Struct,
)

STR, BOOL, INT, INT64 = String(), Bool(), Int(64), Int(64)
UINT16, UINT32, UINT64 = Int(16, signed=False), Int(32, signed=False), Int(64, signed=False)
STRINGS = Slice(STR)
LABELS = Map(STR)

HEALTH_CONFIG = Struct(
    ("Test", STRINGS),
    ("Interval", INT64),
    ("Timeout", INT64),
    ("StartPeriod", INT64),
    ("StartInterval", INT64),
    ("Retries", INT),
)

# container.Config, embedded in the create body: its fields sit at the top level.
CONFIG_FIELDS = (
    ("Hostname", STR),
    ("Domainname", STR),
    ("User", STR),
    ("AttachStdin", BOOL),
    ("AttachStdout", BOOL),
    ("AttachStderr", BOOL),
    ("ExposedPorts", Map(EmptyStruct())),
    ("Tty", BOOL),
    ("OpenStdin", BOOL),
    ("StdinOnce", BOOL),
    ("Env", STRINGS),
    ("Cmd", StrSlice()),
    ("Healthcheck", Ptr(HEALTH_CONFIG)),
    ("ArgsEscaped", BOOL),
    ("Image", STR),
    ("Volumes", Map(EmptyStruct())),
    ("WorkingDir", STR),
    ("Entrypoint", StrSlice()),
    ("NetworkDisabled", BOOL),
    ("MacAddress", STR),
    ("OnBuild", STRINGS),
    ("Labels", LABELS),
    ("StopSignal", STR),
    ("StopTimeout", Ptr(INT)),
    ("Shell", StrSlice()),
)

WEIGHT_DEVICE = Ptr(Struct(("Path", STR), ("Weight", UINT16)))
THROTTLE_DEVICE = Ptr(Struct(("Path", STR), ("Rate", UINT64)))
DEVICE_MAPPING = Struct(("PathOnHost", STR), ("PathInContainer", STR), ("CgroupPermissions", STR))
DEVICE_REQUEST = Struct(
    ("Driver", STR),
    ("Count", INT),
    ("DeviceIDs", STRINGS),
    ("Capabilities", Slice(STRINGS)),
    ("Options", LABELS),
)
ULIMIT = Ptr(Struct(("Name", STR), ("Hard", INT64), ("Soft", INT64)))

# container.Resources, embedded in HostConfig.
RESOURCES_FIELDS = (
    ("CpuShares", INT64),
    ("Memory", INT64),
    ("NanoCpus", INT64),
    ("CgroupParent", STR),
    ("BlkioWeight", UINT16),
    ("BlkioWeightDevice", Slice(WEIGHT_DEVICE)),
    ("BlkioDeviceReadBps", Slice(THROTTLE_DEVICE)),
    ("BlkioDeviceWriteBps", Slice(THROTTLE_DEVICE)),
    ("BlkioDeviceReadIOps", Slice(THROTTLE_DEVICE)),
    ("BlkioDeviceWriteIOps", Slice(THROTTLE_DEVICE)),
    ("CpuPeriod", INT64),
    ("CpuQuota", INT64),
    ("CpuRealtimePeriod", INT64),
    ("CpuRealtimeRuntime", INT64),
    ("CpusetCpus", STR),
    ("CpusetMems", STR),
    ("Devices", Slice(DEVICE_MAPPING)),
    ("DeviceCgroupRules", STRINGS),
    ("DeviceRequests", Slice(DEVICE_REQUEST)),
    ("KernelMemory", INT64),
    ("KernelMemoryTCP", INT64),
    ("MemoryReservation", INT64),
    ("MemorySwap", INT64),
    ("MemorySwappiness", Ptr(INT64)),
    ("OomKillDisable", Ptr(BOOL)),
    ("PidsLimit", Ptr(INT64)),
    ("Ulimits", Slice(ULIMIT)),
    ("CpuCount", INT64),
    ("CpuPercent", INT64),
    ("IOMaximumIOps", UINT64),
    ("IOMaximumBandwidth", UINT64),
)

MOUNT = Struct(
    ("Type", STR),
    ("Source", STR),
    ("Target", STR),
    ("ReadOnly", BOOL),
    ("Consistency", STR),
    (
        "BindOptions",
        Ptr(
            Struct(
                ("Propagation", STR),
                ("NonRecursive", BOOL),
                ("CreateMountpoint", BOOL),
                ("ReadOnlyNonRecursive", BOOL),
                ("ReadOnlyForceRecursive", BOOL),
            )
        ),
    ),
    (
        "VolumeOptions",
        Ptr(
            Struct(
                ("NoCopy", BOOL),
                ("Labels", LABELS),
                ("Subpath", STR),
                ("DriverConfig", Ptr(Struct(("Name", STR), ("Options", LABELS)))),
            )
        ),
    ),
    ("ImageOptions", Ptr(Struct(("Subpath", STR)))),
    (
        "TmpfsOptions",
        Ptr(Struct(("SizeBytes", INT64), ("Mode", UINT32), ("Options", Slice(STRINGS)))),
    ),
    ("ClusterOptions", Ptr(AnyValue())),
)

HOST_CONFIG = Struct(
    ("Binds", STRINGS),
    ("ContainerIDFile", STR),
    ("LogConfig", Struct(("Type", STR), ("Config", LABELS))),
    ("NetworkMode", STR),
    ("PortBindings", Map(Slice(Struct(("HostIp", STR), ("HostPort", STR))))),
    ("RestartPolicy", Struct(("Name", STR), ("MaximumRetryCount", INT))),
    ("AutoRemove", BOOL),
    ("VolumeDriver", STR),
    ("VolumesFrom", STRINGS),
    ("ConsoleSize", Array(Int(64, signed=False), 2)),
    ("Annotations", LABELS),
    ("CapAdd", StrSlice()),
    ("CapDrop", StrSlice()),
    ("CgroupnsMode", STR),
    ("Dns", STRINGS),
    ("DnsOptions", STRINGS),
    ("DnsSearch", STRINGS),
    ("ExtraHosts", STRINGS),
    ("GroupAdd", STRINGS),
    ("IpcMode", STR),
    ("Cgroup", STR),
    ("Links", STRINGS),
    ("OomScoreAdj", INT),
    ("PidMode", STR),
    ("Privileged", BOOL),
    ("PublishAllPorts", BOOL),
    ("ReadonlyRootfs", BOOL),
    ("SecurityOpt", STRINGS),
    ("StorageOpt", LABELS),
    ("Tmpfs", LABELS),
    ("UTSMode", STR),
    ("UsernsMode", STR),
    ("ShmSize", INT64),
    ("Sysctls", LABELS),
    ("Runtime", STR),
    ("Isolation", STR),
    *RESOURCES_FIELDS,
    ("Mounts", Slice(MOUNT)),
    ("MaskedPaths", STRINGS),
    ("ReadonlyPaths", STRINGS),
    ("Init", Ptr(BOOL)),
)

ENDPOINT_SETTINGS = Ptr(
    Struct(
        (
            "IPAMConfig",
            Ptr(Struct(("IPv4Address", STR), ("IPv6Address", STR), ("LinkLocalIPs", STRINGS))),
        ),
        ("Links", STRINGS),
        ("Aliases", STRINGS),
        ("DriverOpts", LABELS),
        ("GwPriority", INT),
        ("NetworkID", STR),
        ("EndpointID", STR),
        ("Gateway", STR),
        ("IPAddress", STR),
        ("IPPrefixLen", INT),
        ("IPv6Gateway", STR),
        ("GlobalIPv6Address", STR),
        ("GlobalIPv6PrefixLen", INT),
        ("MacAddress", STR),
        ("DNSNames", STRINGS),
    )
)

CONTAINER_CREATE = Struct(
    *CONFIG_FIELDS,
    ("HostConfig", Ptr(HOST_CONFIG)),
    ("NetworkingConfig", Ptr(Struct(("EndpointsConfig", Map(ENDPOINT_SETTINGS))))),
)

NETWORK_CREATE = Struct(
    ("Name", STR),
    ("CheckDuplicate", BOOL),
    ("Driver", STR),
    ("Scope", STR),
    ("EnableIPv4", Ptr(BOOL)),
    ("EnableIPv6", Ptr(BOOL)),
    (
        "IPAM",
        Ptr(
            Struct(
                ("Driver", STR),
                ("Options", LABELS),
                (
                    "Config",
                    Slice(
                        Struct(
                            ("Subnet", STR),
                            ("IPRange", STR),
                            ("Gateway", STR),
                            ("AuxiliaryAddresses", LABELS),
                        )
                    ),
                ),
            )
        ),
    ),
    ("Internal", BOOL),
    ("Attachable", BOOL),
    ("Ingress", BOOL),
    ("ConfigOnly", BOOL),
    ("ConfigFrom", Ptr(Struct(("Network", STR)))),
    ("Options", LABELS),
    ("Labels", LABELS),
)

VOLUME_CREATE = Struct(
    ("Name", STR),
    ("Driver", STR),
    ("DriverOpts", LABELS),
    ("Labels", LABELS),
    ("ClusterVolumeSpec", Ptr(AnyValue())),
)

# The ``filters`` query parameter: map[string]map[string]bool, or the legacy
# map[string][]string Docker falls back to when the first form does not decode.
FILTERS = Map(Map(Bool()))
LEGACY_FILTERS = Map(Slice(STR))
