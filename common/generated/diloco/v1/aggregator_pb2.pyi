from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_FP32: _ClassVar[Codec]
    CODEC_BF16: _ClassVar[Codec]
    CODEC_FP4_E2M1: _ClassVar[Codec]
    CODEC_FP4_E3M0: _ClassVar[Codec]
    CODEC_SPARSE_2BIT: _ClassVar[Codec]

class PushKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUSH_KIND_UNSPECIFIED: _ClassVar[PushKind]
    PUSH_KIND_DELTA: _ClassVar[PushKind]
    PUSH_KIND_INITIAL: _ClassVar[PushKind]

class PullKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PULL_KIND_UNSPECIFIED: _ClassVar[PullKind]
    PULL_KIND_SNAPSHOT: _ClassVar[PullKind]
    PULL_KIND_UP_TO_DATE: _ClassVar[PullKind]
    PULL_KIND_UPDATES: _ClassVar[PullKind]
CODEC_UNSPECIFIED: Codec
CODEC_FP32: Codec
CODEC_BF16: Codec
CODEC_FP4_E2M1: Codec
CODEC_FP4_E3M0: Codec
CODEC_SPARSE_2BIT: Codec
PUSH_KIND_UNSPECIFIED: PushKind
PUSH_KIND_DELTA: PushKind
PUSH_KIND_INITIAL: PushKind
PULL_KIND_UNSPECIFIED: PullKind
PULL_KIND_SNAPSHOT: PullKind
PULL_KIND_UP_TO_DATE: PullKind
PULL_KIND_UPDATES: PullKind

class EncodedTensor(_message.Message):
    __slots__ = ("codec", "shape", "payload", "scales", "crc32", "sparse_k")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    SPARSE_K_FIELD_NUMBER: _ClassVar[int]
    codec: Codec
    shape: _containers.RepeatedScalarFieldContainer[int]
    payload: bytes
    scales: bytes
    crc32: int
    sparse_k: int
    def __init__(self, codec: _Optional[_Union[Codec, str]] = ..., shape: _Optional[_Iterable[int]] = ..., payload: _Optional[bytes] = ..., scales: _Optional[bytes] = ..., crc32: _Optional[int] = ..., sparse_k: _Optional[int] = ...) -> None: ...

class EncodedFragment(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[EncodedTensor]
    def __init__(self, tensors: _Optional[_Iterable[_Union[EncodedTensor, _Mapping]]] = ...) -> None: ...

class FragmentUpdates(_message.Message):
    __slots__ = ("from_version", "updates")
    FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    from_version: int
    updates: _containers.RepeatedCompositeFieldContainer[EncodedFragment]
    def __init__(self, from_version: _Optional[int] = ..., updates: _Optional[_Iterable[_Union[EncodedFragment, _Mapping]]] = ...) -> None: ...

class ParamSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class FragmentLayout(_message.Message):
    __slots__ = ("fragment_id", "param_indices", "version")
    FRAGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    PARAM_INDICES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    fragment_id: int
    param_indices: _containers.RepeatedScalarFieldContainer[int]
    version: int
    def __init__(self, fragment_id: _Optional[int] = ..., param_indices: _Optional[_Iterable[int]] = ..., version: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("learner_id", "fingerprint", "codecs", "tokens_per_step")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    fingerprint: _containers.RepeatedCompositeFieldContainer[ParamSpec]
    codecs: _containers.RepeatedScalarFieldContainer[Codec]
    tokens_per_step: int
    def __init__(self, learner_id: _Optional[str] = ..., fingerprint: _Optional[_Iterable[_Union[ParamSpec, _Mapping]]] = ..., codecs: _Optional[_Iterable[_Union[Codec, str]]] = ..., tokens_per_step: _Optional[int] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("session_id", "server_epoch", "fragments", "lease_s", "mode", "layout", "schedule_step", "shard_index", "shard_count", "map_id", "fragment_owners")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SERVER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_STEP_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    MAP_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_OWNERS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    server_epoch: int
    fragments: _containers.RepeatedCompositeFieldContainer[FragmentLayout]
    lease_s: float
    mode: str
    layout: str
    schedule_step: int
    shard_index: int
    shard_count: int
    map_id: str
    fragment_owners: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., server_epoch: _Optional[int] = ..., fragments: _Optional[_Iterable[_Union[FragmentLayout, _Mapping]]] = ..., lease_s: _Optional[float] = ..., mode: _Optional[str] = ..., layout: _Optional[str] = ..., schedule_step: _Optional[int] = ..., shard_index: _Optional[int] = ..., shard_count: _Optional[int] = ..., map_id: _Optional[str] = ..., fragment_owners: _Optional[_Iterable[int]] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("session_id", "fragment_id", "base_version", "inner_steps", "tokens", "kind", "payload_bytes", "slice_index", "slice_count")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SLICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    fragment_id: int
    base_version: int
    inner_steps: int
    tokens: int
    kind: PushKind
    payload_bytes: int
    slice_index: int
    slice_count: int
    def __init__(self, session_id: _Optional[str] = ..., fragment_id: _Optional[int] = ..., base_version: _Optional[int] = ..., inner_steps: _Optional[int] = ..., tokens: _Optional[int] = ..., kind: _Optional[_Union[PushKind, str]] = ..., payload_bytes: _Optional[int] = ..., slice_index: _Optional[int] = ..., slice_count: _Optional[int] = ...) -> None: ...

class PushFragmentRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class PushFragmentResponse(_message.Message):
    __slots__ = ("accepted", "round_version", "reason", "slices_pending")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ROUND_VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SLICES_PENDING_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    round_version: int
    reason: str
    slices_pending: bool
    def __init__(self, accepted: _Optional[bool] = ..., round_version: _Optional[int] = ..., reason: _Optional[str] = ..., slices_pending: _Optional[bool] = ...) -> None: ...

class PullParamsRequest(_message.Message):
    __slots__ = ("session_id", "fragment_id", "have_version", "wait_for_version", "wait_timeout_s", "slice_index", "slice_count")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    HAVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SLICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SLICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    fragment_id: int
    have_version: int
    wait_for_version: int
    wait_timeout_s: float
    slice_index: int
    slice_count: int
    def __init__(self, session_id: _Optional[str] = ..., fragment_id: _Optional[int] = ..., have_version: _Optional[int] = ..., wait_for_version: _Optional[int] = ..., wait_timeout_s: _Optional[float] = ..., slice_index: _Optional[int] = ..., slice_count: _Optional[int] = ...) -> None: ...

class PullHeader(_message.Message):
    __slots__ = ("fragment_id", "version", "kind", "payload_bytes", "params_crc32")
    FRAGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARAMS_CRC32_FIELD_NUMBER: _ClassVar[int]
    fragment_id: int
    version: int
    kind: PullKind
    payload_bytes: int
    params_crc32: int
    def __init__(self, fragment_id: _Optional[int] = ..., version: _Optional[int] = ..., kind: _Optional[_Union[PullKind, str]] = ..., payload_bytes: _Optional[int] = ..., params_crc32: _Optional[int] = ...) -> None: ...

class PullParamsResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    chunk: bytes
    def __init__(self, header: _Optional[_Union[PullHeader, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("session_id", "step", "tokens", "step_time_s", "loss", "schedule_step")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_STEP_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    step: int
    tokens: int
    step_time_s: float
    loss: float
    schedule_step: int
    def __init__(self, session_id: _Optional[str] = ..., step: _Optional[int] = ..., tokens: _Optional[int] = ..., step_time_s: _Optional[float] = ..., loss: _Optional[float] = ..., schedule_step: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("server_epoch", "fragment_versions", "live_learners", "median_step_time_s", "schedule_step")
    SERVER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    LIVE_LEARNERS_FIELD_NUMBER: _ClassVar[int]
    MEDIAN_STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_STEP_FIELD_NUMBER: _ClassVar[int]
    server_epoch: int
    fragment_versions: _containers.RepeatedScalarFieldContainer[int]
    live_learners: int
    median_step_time_s: float
    schedule_step: int
    def __init__(self, server_epoch: _Optional[int] = ..., fragment_versions: _Optional[_Iterable[int]] = ..., live_learners: _Optional[int] = ..., median_step_time_s: _Optional[float] = ..., schedule_step: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeShardsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeShardsResponse(_message.Message):
    __slots__ = ("shard_index", "shard_count", "map_id", "addresses", "fingerprint_hash", "fragments", "fragment_owners")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    MAP_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_HASH_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_OWNERS_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    shard_count: int
    map_id: str
    addresses: _containers.RepeatedScalarFieldContainer[str]
    fingerprint_hash: str
    fragments: int
    fragment_owners: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, shard_index: _Optional[int] = ..., shard_count: _Optional[int] = ..., map_id: _Optional[str] = ..., addresses: _Optional[_Iterable[str]] = ..., fingerprint_hash: _Optional[str] = ..., fragments: _Optional[int] = ..., fragment_owners: _Optional[_Iterable[int]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FragmentStatus(_message.Message):
    __slots__ = ("fragment_id", "version", "owner", "params_crc32")
    FRAGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    PARAMS_CRC32_FIELD_NUMBER: _ClassVar[int]
    fragment_id: int
    version: int
    owner: int
    params_crc32: int
    def __init__(self, fragment_id: _Optional[int] = ..., version: _Optional[int] = ..., owner: _Optional[int] = ..., params_crc32: _Optional[int] = ...) -> None: ...

class LearnerStatus(_message.Message):
    __slots__ = ("learner_id", "live", "last_push_fragment", "last_push_version", "last_push_age_s")
    LEARNER_ID_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    LAST_PUSH_FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    LAST_PUSH_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_PUSH_AGE_S_FIELD_NUMBER: _ClassVar[int]
    learner_id: str
    live: bool
    last_push_fragment: int
    last_push_version: int
    last_push_age_s: float
    def __init__(self, learner_id: _Optional[str] = ..., live: _Optional[bool] = ..., last_push_fragment: _Optional[int] = ..., last_push_version: _Optional[int] = ..., last_push_age_s: _Optional[float] = ...) -> None: ...

class SettingChange(_message.Message):
    __slots__ = ("setting", "was", "now")
    SETTING_FIELD_NUMBER: _ClassVar[int]
    WAS_FIELD_NUMBER: _ClassVar[int]
    NOW_FIELD_NUMBER: _ClassVar[int]
    setting: str
    was: str
    now: str
    def __init__(self, setting: _Optional[str] = ..., was: _Optional[str] = ..., now: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("shard_index", "shard_count", "map_id", "mode", "fragments", "rounds_closed", "learners", "setting_changes")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    MAP_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_CLOSED_FIELD_NUMBER: _ClassVar[int]
    LEARNERS_FIELD_NUMBER: _ClassVar[int]
    SETTING_CHANGES_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    shard_count: int
    map_id: str
    mode: str
    fragments: _containers.RepeatedCompositeFieldContainer[FragmentStatus]
    rounds_closed: int
    learners: _containers.RepeatedCompositeFieldContainer[LearnerStatus]
    setting_changes: _containers.RepeatedCompositeFieldContainer[SettingChange]
    def __init__(self, shard_index: _Optional[int] = ..., shard_count: _Optional[int] = ..., map_id: _Optional[str] = ..., mode: _Optional[str] = ..., fragments: _Optional[_Iterable[_Union[FragmentStatus, _Mapping]]] = ..., rounds_closed: _Optional[int] = ..., learners: _Optional[_Iterable[_Union[LearnerStatus, _Mapping]]] = ..., setting_changes: _Optional[_Iterable[_Union[SettingChange, _Mapping]]] = ...) -> None: ...
