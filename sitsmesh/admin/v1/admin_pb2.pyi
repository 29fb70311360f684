import datetime

from google.protobuf import field_mask_pb2 as _field_mask_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProfileTarget(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROFILE_TARGET_UNSPECIFIED: _ClassVar[ProfileTarget]
    PROFILE_TARGET_PREFLIGHT: _ClassVar[ProfileTarget]
    PROFILE_TARGET_PRODUCTION: _ClassVar[ProfileTarget]

class RateSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RATE_SOURCE_UNSPECIFIED: _ClassVar[RateSource]
    RATE_SOURCE_LIVE: _ClassVar[RateSource]
    RATE_SOURCE_GIVEN: _ClassVar[RateSource]
    RATE_SOURCE_ASSUMED: _ClassVar[RateSource]

class ServingState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVING_STATE_UNSPECIFIED: _ClassVar[ServingState]
    SERVING_STATE_SERVING: _ClassVar[ServingState]
    SERVING_STATE_NOT_SERVING: _ClassVar[ServingState]
    SERVING_STATE_DRAINING: _ClassVar[ServingState]

class PressureLevel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRESSURE_LEVEL_UNSPECIFIED: _ClassVar[PressureLevel]
    PRESSURE_LEVEL_OK: _ClassVar[PressureLevel]
    PRESSURE_LEVEL_HIGH: _ClassVar[PressureLevel]
    PRESSURE_LEVEL_OVERLOADED: _ClassVar[PressureLevel]
    PRESSURE_LEVEL_STALE: _ClassVar[PressureLevel]

class OverloadReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OVERLOAD_REASON_UNSPECIFIED: _ClassVar[OverloadReason]
    OVERLOAD_REASON_SURGE: _ClassVar[OverloadReason]
    OVERLOAD_REASON_FULL: _ClassVar[OverloadReason]
    OVERLOAD_REASON_STANDING: _ClassVar[OverloadReason]
    OVERLOAD_REASON_ERRORS: _ClassVar[OverloadReason]
    OVERLOAD_REASON_LATE: _ClassVar[OverloadReason]

class SignalSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SIGNAL_SOURCE_UNSPECIFIED: _ClassVar[SignalSource]
    SIGNAL_SOURCE_ACCESS_LOG: _ClassVar[SignalSource]
    SIGNAL_SOURCE_ENVOY_STATS: _ClassVar[SignalSource]
    SIGNAL_SOURCE_TRITON_METRICS: _ClassVar[SignalSource]

class SwapPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SWAP_PHASE_UNSPECIFIED: _ClassVar[SwapPhase]
    SWAP_PHASE_PRECHECK: _ClassVar[SwapPhase]
    SWAP_PHASE_PREFLIGHT: _ClassVar[SwapPhase]
    SWAP_PHASE_LOAD: _ClassVar[SwapPhase]
    SWAP_PHASE_VERIFY: _ClassVar[SwapPhase]
    SWAP_PHASE_PROMOTE: _ClassVar[SwapPhase]
    SWAP_PHASE_DRAIN: _ClassVar[SwapPhase]
    SWAP_PHASE_RETIRE: _ClassVar[SwapPhase]
    SWAP_PHASE_ROLLBACK: _ClassVar[SwapPhase]

class StepState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_STATE_UNSPECIFIED: _ClassVar[StepState]
    STEP_STATE_RUNNING: _ClassVar[StepState]
    STEP_STATE_OK: _ClassVar[StepState]
    STEP_STATE_FAILED: _ClassVar[StepState]
    STEP_STATE_SKIPPED: _ClassVar[StepState]

class SwapState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SWAP_STATE_UNSPECIFIED: _ClassVar[SwapState]
    SWAP_STATE_RUNNING: _ClassVar[SwapState]
    SWAP_STATE_SUCCEEDED: _ClassVar[SwapState]
    SWAP_STATE_ROLLED_BACK: _ClassVar[SwapState]
    SWAP_STATE_FAILED: _ClassVar[SwapState]
    SWAP_STATE_INTERRUPTED: _ClassVar[SwapState]

class PressurePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRESSURE_POLICY_UNSPECIFIED: _ClassVar[PressurePolicy]
    PRESSURE_POLICY_SITSMESH: _ClassVar[PressurePolicy]
    PRESSURE_POLICY_SEED: _ClassVar[PressurePolicy]
    PRESSURE_POLICY_OFF: _ClassVar[PressurePolicy]

class WarmupData(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WARMUP_DATA_UNSPECIFIED: _ClassVar[WarmupData]
    WARMUP_DATA_ZERO: _ClassVar[WarmupData]
    WARMUP_DATA_RANDOM: _ClassVar[WarmupData]

class Listener(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LISTENER_UNSPECIFIED: _ClassVar[Listener]
    LISTENER_DATA: _ClassVar[Listener]
    LISTENER_ADMIN: _ClassVar[Listener]
PROFILE_TARGET_UNSPECIFIED: ProfileTarget
PROFILE_TARGET_PREFLIGHT: ProfileTarget
PROFILE_TARGET_PRODUCTION: ProfileTarget
RATE_SOURCE_UNSPECIFIED: RateSource
RATE_SOURCE_LIVE: RateSource
RATE_SOURCE_GIVEN: RateSource
RATE_SOURCE_ASSUMED: RateSource
SERVING_STATE_UNSPECIFIED: ServingState
SERVING_STATE_SERVING: ServingState
SERVING_STATE_NOT_SERVING: ServingState
SERVING_STATE_DRAINING: ServingState
PRESSURE_LEVEL_UNSPECIFIED: PressureLevel
PRESSURE_LEVEL_OK: PressureLevel
PRESSURE_LEVEL_HIGH: PressureLevel
PRESSURE_LEVEL_OVERLOADED: PressureLevel
PRESSURE_LEVEL_STALE: PressureLevel
OVERLOAD_REASON_UNSPECIFIED: OverloadReason
OVERLOAD_REASON_SURGE: OverloadReason
OVERLOAD_REASON_FULL: OverloadReason
OVERLOAD_REASON_STANDING: OverloadReason
OVERLOAD_REASON_ERRORS: OverloadReason
OVERLOAD_REASON_LATE: OverloadReason
SIGNAL_SOURCE_UNSPECIFIED: SignalSource
SIGNAL_SOURCE_ACCESS_LOG: SignalSource
SIGNAL_SOURCE_ENVOY_STATS: SignalSource
SIGNAL_SOURCE_TRITON_METRICS: SignalSource
SWAP_PHASE_UNSPECIFIED: SwapPhase
SWAP_PHASE_PRECHECK: SwapPhase
SWAP_PHASE_PREFLIGHT: SwapPhase
SWAP_PHASE_LOAD: SwapPhase
SWAP_PHASE_VERIFY: SwapPhase
SWAP_PHASE_PROMOTE: SwapPhase
SWAP_PHASE_DRAIN: SwapPhase
SWAP_PHASE_RETIRE: SwapPhase
SWAP_PHASE_ROLLBACK: SwapPhase
STEP_STATE_UNSPECIFIED: StepState
STEP_STATE_RUNNING: StepState
STEP_STATE_OK: StepState
STEP_STATE_FAILED: StepState
STEP_STATE_SKIPPED: StepState
SWAP_STATE_UNSPECIFIED: SwapState
SWAP_STATE_RUNNING: SwapState
SWAP_STATE_SUCCEEDED: SwapState
SWAP_STATE_ROLLED_BACK: SwapState
SWAP_STATE_FAILED: SwapState
SWAP_STATE_INTERRUPTED: SwapState
PRESSURE_POLICY_UNSPECIFIED: PressurePolicy
PRESSURE_POLICY_SITSMESH: PressurePolicy
PRESSURE_POLICY_SEED: PressurePolicy
PRESSURE_POLICY_OFF: PressurePolicy
WARMUP_DATA_UNSPECIFIED: WarmupData
WARMUP_DATA_ZERO: WarmupData
WARMUP_DATA_RANDOM: WarmupData
LISTENER_UNSPECIFIED: Listener
LISTENER_DATA: Listener
LISTENER_ADMIN: Listener

class ProfileModelRequest(_message.Message):
    __slots__ = ("model", "endpoint", "batch_sizes", "concurrency", "requests", "seconds", "target", "allow_production", "max_rate")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    ALLOW_PRODUCTION_FIELD_NUMBER: _ClassVar[int]
    MAX_RATE_FIELD_NUMBER: _ClassVar[int]
    model: str
    endpoint: str
    batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    concurrency: int
    requests: int
    seconds: float
    target: ProfileTarget
    allow_production: bool
    max_rate: float
    def __init__(self, model: _Optional[str] = ..., endpoint: _Optional[str] = ..., batch_sizes: _Optional[_Iterable[int]] = ..., concurrency: _Optional[int] = ..., requests: _Optional[int] = ..., seconds: _Optional[float] = ..., target: _Optional[_Union[ProfileTarget, str]] = ..., allow_production: _Optional[bool] = ..., max_rate: _Optional[float] = ...) -> None: ...

class BatchPoint(_message.Message):
    __slots__ = ("batch_size", "throughput", "p50_ms", "p99_ms", "requests")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    P50_MS_FIELD_NUMBER: _ClassVar[int]
    P99_MS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    throughput: float
    p50_ms: float
    p99_ms: float
    requests: int
    def __init__(self, batch_size: _Optional[int] = ..., throughput: _Optional[float] = ..., p50_ms: _Optional[float] = ..., p99_ms: _Optional[float] = ..., requests: _Optional[int] = ...) -> None: ...

class BatchingCurve(_message.Message):
    __slots__ = ("model", "endpoint", "target", "instances", "max_batch_size", "concurrency", "measured_at", "points", "knee", "pareto")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    MEASURED_AT_FIELD_NUMBER: _ClassVar[int]
    POINTS_FIELD_NUMBER: _ClassVar[int]
    KNEE_FIELD_NUMBER: _ClassVar[int]
    PARETO_FIELD_NUMBER: _ClassVar[int]
    model: str
    endpoint: str
    target: ProfileTarget
    instances: int
    max_batch_size: int
    concurrency: int
    measured_at: _timestamp_pb2.Timestamp
    points: _containers.RepeatedCompositeFieldContainer[BatchPoint]
    knee: int
    pareto: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., endpoint: _Optional[str] = ..., target: _Optional[_Union[ProfileTarget, str]] = ..., instances: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., concurrency: _Optional[int] = ..., measured_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., points: _Optional[_Iterable[_Union[BatchPoint, _Mapping]]] = ..., knee: _Optional[int] = ..., pareto: _Optional[_Iterable[int]] = ...) -> None: ...

class ProfileModelResponse(_message.Message):
    __slots__ = ("point", "curve")
    POINT_FIELD_NUMBER: _ClassVar[int]
    CURVE_FIELD_NUMBER: _ClassVar[int]
    point: BatchPoint
    curve: BatchingCurve
    def __init__(self, point: _Optional[_Union[BatchPoint, _Mapping]] = ..., curve: _Optional[_Union[BatchingCurve, _Mapping]] = ...) -> None: ...

class GetModelProfileRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class GetModelProfileResponse(_message.Message):
    __slots__ = ("curve",)
    CURVE_FIELD_NUMBER: _ClassVar[int]
    curve: BatchingCurve
    def __init__(self, curve: _Optional[_Union[BatchingCurve, _Mapping]] = ...) -> None: ...

class DynamicBatching(_message.Message):
    __slots__ = ("enabled", "preferred_batch_size", "max_queue_delay_microseconds")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_DELAY_MICROSECONDS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    preferred_batch_size: _containers.RepeatedScalarFieldContainer[int]
    max_queue_delay_microseconds: int
    def __init__(self, enabled: _Optional[bool] = ..., preferred_batch_size: _Optional[_Iterable[int]] = ..., max_queue_delay_microseconds: _Optional[int] = ...) -> None: ...

class BatchingPrediction(_message.Message):
    __slots__ = ("batching", "p99_ms", "p50_ms", "throughput", "mean_batch", "headroom", "stable")
    BATCHING_FIELD_NUMBER: _ClassVar[int]
    P99_MS_FIELD_NUMBER: _ClassVar[int]
    P50_MS_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    MEAN_BATCH_FIELD_NUMBER: _ClassVar[int]
    HEADROOM_FIELD_NUMBER: _ClassVar[int]
    STABLE_FIELD_NUMBER: _ClassVar[int]
    batching: DynamicBatching
    p99_ms: float
    p50_ms: float
    throughput: float
    mean_batch: float
    headroom: float
    stable: bool
    def __init__(self, batching: _Optional[_Union[DynamicBatching, _Mapping]] = ..., p99_ms: _Optional[float] = ..., p50_ms: _Optional[float] = ..., throughput: _Optional[float] = ..., mean_batch: _Optional[float] = ..., headroom: _Optional[float] = ..., stable: _Optional[bool] = ...) -> None: ...

class BatchingRecommendation(_message.Message):
    __slots__ = ("model", "rate", "rate_source", "sla_ms", "knee", "current", "proposed", "capacity", "reason", "changes", "pipeline", "stage")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RATE_FIELD_NUMBER: _ClassVar[int]
    RATE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    SLA_MS_FIELD_NUMBER: _ClassVar[int]
    KNEE_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    model: str
    rate: float
    rate_source: RateSource
    sla_ms: float
    knee: int
    current: BatchingPrediction
    proposed: BatchingPrediction
    capacity: float
    reason: str
    changes: bool
    pipeline: str
    stage: str
    def __init__(self, model: _Optional[str] = ..., rate: _Optional[float] = ..., rate_source: _Optional[_Union[RateSource, str]] = ..., sla_ms: _Optional[float] = ..., knee: _Optional[int] = ..., current: _Optional[_Union[BatchingPrediction, _Mapping]] = ..., proposed: _Optional[_Union[BatchingPrediction, _Mapping]] = ..., capacity: _Optional[float] = ..., reason: _Optional[str] = ..., changes: _Optional[bool] = ..., pipeline: _Optional[str] = ..., stage: _Optional[str] = ...) -> None: ...

class TuneModelRequest(_message.Message):
    __slots__ = ("model", "endpoint", "dry_run", "rate", "sla_ms", "pipeline", "options", "batching", "watch_s")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    RATE_FIELD_NUMBER: _ClassVar[int]
    SLA_MS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    BATCHING_FIELD_NUMBER: _ClassVar[int]
    WATCH_S_FIELD_NUMBER: _ClassVar[int]
    model: str
    endpoint: str
    dry_run: bool
    rate: float
    sla_ms: float
    pipeline: str
    options: SwapOptions
    batching: DynamicBatching
    watch_s: float
    def __init__(self, model: _Optional[str] = ..., endpoint: _Optional[str] = ..., dry_run: _Optional[bool] = ..., rate: _Optional[float] = ..., sla_ms: _Optional[float] = ..., pipeline: _Optional[str] = ..., options: _Optional[_Union[SwapOptions, _Mapping]] = ..., batching: _Optional[_Union[DynamicBatching, _Mapping]] = ..., watch_s: _Optional[float] = ...) -> None: ...

class TuneModelResponse(_message.Message):
    __slots__ = ("recommendation", "progress")
    RECOMMENDATION_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    recommendation: BatchingRecommendation
    progress: SwapModelResponse
    def __init__(self, recommendation: _Optional[_Union[BatchingRecommendation, _Mapping]] = ..., progress: _Optional[_Union[SwapModelResponse, _Mapping]] = ...) -> None: ...

class AutoTuning(_message.Message):
    __slots__ = ("pipeline", "enabled", "hold_s", "cooldown_s")
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    HOLD_S_FIELD_NUMBER: _ClassVar[int]
    COOLDOWN_S_FIELD_NUMBER: _ClassVar[int]
    pipeline: str
    enabled: bool
    hold_s: float
    cooldown_s: float
    def __init__(self, pipeline: _Optional[str] = ..., enabled: _Optional[bool] = ..., hold_s: _Optional[float] = ..., cooldown_s: _Optional[float] = ...) -> None: ...

class SetAutoTuningRequest(_message.Message):
    __slots__ = ("auto_tuning",)
    AUTO_TUNING_FIELD_NUMBER: _ClassVar[int]
    auto_tuning: AutoTuning
    def __init__(self, auto_tuning: _Optional[_Union[AutoTuning, _Mapping]] = ...) -> None: ...

class SetAutoTuningResponse(_message.Message):
    __slots__ = ("auto_tuning",)
    AUTO_TUNING_FIELD_NUMBER: _ClassVar[int]
    auto_tuning: AutoTuning
    def __init__(self, auto_tuning: _Optional[_Union[AutoTuning, _Mapping]] = ...) -> None: ...

class GetAutoTuningRequest(_message.Message):
    __slots__ = ("pipeline",)
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    pipeline: str
    def __init__(self, pipeline: _Optional[str] = ...) -> None: ...

class GetAutoTuningResponse(_message.Message):
    __slots__ = ("auto_tuning",)
    AUTO_TUNING_FIELD_NUMBER: _ClassVar[int]
    auto_tuning: AutoTuning
    def __init__(self, auto_tuning: _Optional[_Union[AutoTuning, _Mapping]] = ...) -> None: ...

class BatchingChange(_message.Message):
    __slots__ = ("model", "actor", "at", "previous", "batching", "reason", "swap_id", "outcome", "automatic", "pipeline", "rate")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    BATCHING_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SWAP_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    AUTOMATIC_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    RATE_FIELD_NUMBER: _ClassVar[int]
    model: str
    actor: str
    at: _timestamp_pb2.Timestamp
    previous: DynamicBatching
    batching: DynamicBatching
    reason: str
    swap_id: str
    outcome: SwapState
    automatic: bool
    pipeline: str
    rate: float
    def __init__(self, model: _Optional[str] = ..., actor: _Optional[str] = ..., at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., previous: _Optional[_Union[DynamicBatching, _Mapping]] = ..., batching: _Optional[_Union[DynamicBatching, _Mapping]] = ..., reason: _Optional[str] = ..., swap_id: _Optional[str] = ..., outcome: _Optional[_Union[SwapState, str]] = ..., automatic: _Optional[bool] = ..., pipeline: _Optional[str] = ..., rate: _Optional[float] = ...) -> None: ...

class ListBatchingChangesRequest(_message.Message):
    __slots__ = ("model", "page_size", "page_token")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    model: str
    page_size: int
    page_token: str
    def __init__(self, model: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListBatchingChangesResponse(_message.Message):
    __slots__ = ("changes", "next_page_token")
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    changes: _containers.RepeatedCompositeFieldContainer[BatchingChange]
    next_page_token: str
    def __init__(self, changes: _Optional[_Iterable[_Union[BatchingChange, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetThresholdsRequest(_message.Message):
    __slots__ = ("pipeline",)
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    pipeline: str
    def __init__(self, pipeline: _Optional[str] = ...) -> None: ...

class GetThresholdsResponse(_message.Message):
    __slots__ = ("thresholds",)
    THRESHOLDS_FIELD_NUMBER: _ClassVar[int]
    thresholds: PipelineThresholds
    def __init__(self, thresholds: _Optional[_Union[PipelineThresholds, _Mapping]] = ...) -> None: ...

class PipelineThresholds(_message.Message):
    __slots__ = ("pipeline", "yaml", "is_default")
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    YAML_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    pipeline: str
    yaml: str
    is_default: bool
    def __init__(self, pipeline: _Optional[str] = ..., yaml: _Optional[str] = ..., is_default: _Optional[bool] = ...) -> None: ...

class SetThresholdsRequest(_message.Message):
    __slots__ = ("pipeline", "yaml", "source", "dry_run")
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    YAML_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    pipeline: str
    yaml: str
    source: str
    dry_run: bool
    def __init__(self, pipeline: _Optional[str] = ..., yaml: _Optional[str] = ..., source: _Optional[str] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class SetThresholdsResponse(_message.Message):
    __slots__ = ("thresholds",)
    THRESHOLDS_FIELD_NUMBER: _ClassVar[int]
    thresholds: PipelineThresholds
    def __init__(self, thresholds: _Optional[_Union[PipelineThresholds, _Mapping]] = ...) -> None: ...

class ThresholdChange(_message.Message):
    __slots__ = ("pipeline", "actor", "peer", "at", "before", "after")
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    ACTOR_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    BEFORE_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    pipeline: str
    actor: str
    peer: str
    at: _timestamp_pb2.Timestamp
    before: str
    after: str
    def __init__(self, pipeline: _Optional[str] = ..., actor: _Optional[str] = ..., peer: _Optional[str] = ..., at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., before: _Optional[str] = ..., after: _Optional[str] = ...) -> None: ...

class ListThresholdChangesRequest(_message.Message):
    __slots__ = ("pipeline", "page_size", "page_token", "read_mask")
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    READ_MASK_FIELD_NUMBER: _ClassVar[int]
    pipeline: str
    page_size: int
    page_token: str
    read_mask: _field_mask_pb2.FieldMask
    def __init__(self, pipeline: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., read_mask: _Optional[_Union[_field_mask_pb2.FieldMask, _Mapping]] = ...) -> None: ...

class ListThresholdChangesResponse(_message.Message):
    __slots__ = ("changes", "next_page_token")
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    changes: _containers.RepeatedCompositeFieldContainer[ThresholdChange]
    next_page_token: str
    def __init__(self, changes: _Optional[_Iterable[_Union[ThresholdChange, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class WatchPressureRequest(_message.Message):
    __slots__ = ("pipeline", "interval_ms", "count")
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    pipeline: str
    interval_ms: int
    count: int
    def __init__(self, pipeline: _Optional[str] = ..., interval_ms: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class StagePressure(_message.Message):
    __slots__ = ("name", "level", "pressure", "arrival_rate", "capacity", "utilisation", "queue", "queue_fill", "rt99_ms", "predicted_p99_ms", "headroom_rps", "stale", "reason", "signals", "capacity_samples", "service_cs2")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    PRESSURE_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_RATE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    UTILISATION_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FILL_FIELD_NUMBER: _ClassVar[int]
    RT99_MS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_P99_MS_FIELD_NUMBER: _ClassVar[int]
    HEADROOM_RPS_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SIGNALS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SERVICE_CS2_FIELD_NUMBER: _ClassVar[int]
    name: str
    level: PressureLevel
    pressure: float
    arrival_rate: float
    capacity: float
    utilisation: float
    queue: float
    queue_fill: float
    rt99_ms: float
    predicted_p99_ms: float
    headroom_rps: float
    stale: bool
    reason: OverloadReason
    signals: _containers.RepeatedCompositeFieldContainer[SignalAge]
    capacity_samples: int
    service_cs2: float
    def __init__(self, name: _Optional[str] = ..., level: _Optional[_Union[PressureLevel, str]] = ..., pressure: _Optional[float] = ..., arrival_rate: _Optional[float] = ..., capacity: _Optional[float] = ..., utilisation: _Optional[float] = ..., queue: _Optional[float] = ..., queue_fill: _Optional[float] = ..., rt99_ms: _Optional[float] = ..., predicted_p99_ms: _Optional[float] = ..., headroom_rps: _Optional[float] = ..., stale: _Optional[bool] = ..., reason: _Optional[_Union[OverloadReason, str]] = ..., signals: _Optional[_Iterable[_Union[SignalAge, _Mapping]]] = ..., capacity_samples: _Optional[int] = ..., service_cs2: _Optional[float] = ...) -> None: ...

class SignalAge(_message.Message):
    __slots__ = ("source", "age_s", "stale")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    source: SignalSource
    age_s: float
    stale: bool
    def __init__(self, source: _Optional[_Union[SignalSource, str]] = ..., age_s: _Optional[float] = ..., stale: _Optional[bool] = ...) -> None: ...

class PipelinePressure(_message.Message):
    __slots__ = ("pipeline", "policy", "fraction", "cutoff", "concurrency", "protected_from", "retry_after_s", "bottleneck", "level", "arrival_rate", "in_flight", "shed_total", "stages", "entry_wait_ms", "entry_waiting")
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    FRACTION_FIELD_NUMBER: _ClassVar[int]
    CUTOFF_FIELD_NUMBER: _ClassVar[int]
    CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    PROTECTED_FROM_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    BOTTLENECK_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_RATE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SHED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    ENTRY_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    ENTRY_WAITING_FIELD_NUMBER: _ClassVar[int]
    pipeline: str
    policy: PressurePolicy
    fraction: float
    cutoff: float
    concurrency: int
    protected_from: int
    retry_after_s: int
    bottleneck: str
    level: PressureLevel
    arrival_rate: float
    in_flight: int
    shed_total: int
    stages: _containers.RepeatedCompositeFieldContainer[StagePressure]
    entry_wait_ms: int
    entry_waiting: int
    def __init__(self, pipeline: _Optional[str] = ..., policy: _Optional[_Union[PressurePolicy, str]] = ..., fraction: _Optional[float] = ..., cutoff: _Optional[float] = ..., concurrency: _Optional[int] = ..., protected_from: _Optional[int] = ..., retry_after_s: _Optional[int] = ..., bottleneck: _Optional[str] = ..., level: _Optional[_Union[PressureLevel, str]] = ..., arrival_rate: _Optional[float] = ..., in_flight: _Optional[int] = ..., shed_total: _Optional[int] = ..., stages: _Optional[_Iterable[_Union[StagePressure, _Mapping]]] = ..., entry_wait_ms: _Optional[int] = ..., entry_waiting: _Optional[int] = ...) -> None: ...

class WatchPressureResponse(_message.Message):
    __slots__ = ("at", "pipelines")
    AT_FIELD_NUMBER: _ClassVar[int]
    PIPELINES_FIELD_NUMBER: _ClassVar[int]
    at: _timestamp_pb2.Timestamp
    pipelines: _containers.RepeatedCompositeFieldContainer[PipelinePressure]
    def __init__(self, at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., pipelines: _Optional[_Iterable[_Union[PipelinePressure, _Mapping]]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ("endpoint",)
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    def __init__(self, endpoint: _Optional[str] = ...) -> None: ...

class ModelVersion(_message.Message):
    __slots__ = ("endpoint", "model", "version", "state", "reason")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    model: str
    version: int
    state: str
    reason: str
    def __init__(self, endpoint: _Optional[str] = ..., model: _Optional[str] = ..., version: _Optional[int] = ..., state: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class EndpointError(_message.Message):
    __slots__ = ("endpoint", "error")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    error: str
    def __init__(self, endpoint: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("versions", "errors")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[ModelVersion]
    errors: _containers.RepeatedCompositeFieldContainer[EndpointError]
    def __init__(self, versions: _Optional[_Iterable[_Union[ModelVersion, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[EndpointError, _Mapping]]] = ...) -> None: ...

class SampleValues(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class SwapOptions(_message.Message):
    __slots__ = ("warmup_count", "warmup_data", "sample", "verify_probes", "max_latency_ratio", "latency_slack_ms", "drain_timeout_s", "load_timeout_s", "max_pending")
    class SampleEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: SampleValues
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[SampleValues, _Mapping]] = ...) -> None: ...
    WARMUP_COUNT_FIELD_NUMBER: _ClassVar[int]
    WARMUP_DATA_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_PROBES_FIELD_NUMBER: _ClassVar[int]
    MAX_LATENCY_RATIO_FIELD_NUMBER: _ClassVar[int]
    LATENCY_SLACK_MS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    LOAD_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_PENDING_FIELD_NUMBER: _ClassVar[int]
    warmup_count: int
    warmup_data: WarmupData
    sample: _containers.MessageMap[str, SampleValues]
    verify_probes: int
    max_latency_ratio: float
    latency_slack_ms: float
    drain_timeout_s: float
    load_timeout_s: float
    max_pending: int
    def __init__(self, warmup_count: _Optional[int] = ..., warmup_data: _Optional[_Union[WarmupData, str]] = ..., sample: _Optional[_Mapping[str, SampleValues]] = ..., verify_probes: _Optional[int] = ..., max_latency_ratio: _Optional[float] = ..., latency_slack_ms: _Optional[float] = ..., drain_timeout_s: _Optional[float] = ..., load_timeout_s: _Optional[float] = ..., max_pending: _Optional[int] = ...) -> None: ...

class SwapModelRequest(_message.Message):
    __slots__ = ("model", "target_version", "endpoint", "options")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TARGET_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    target_version: int
    endpoint: str
    options: SwapOptions
    def __init__(self, model: _Optional[str] = ..., target_version: _Optional[int] = ..., endpoint: _Optional[str] = ..., options: _Optional[_Union[SwapOptions, _Mapping]] = ...) -> None: ...

class SwapStep(_message.Message):
    __slots__ = ("phase", "state", "started_at", "ended_at", "message", "detail")
    class DetailEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    phase: SwapPhase
    state: StepState
    started_at: _timestamp_pb2.Timestamp
    ended_at: _timestamp_pb2.Timestamp
    message: str
    detail: _containers.ScalarMap[str, str]
    def __init__(self, phase: _Optional[_Union[SwapPhase, str]] = ..., state: _Optional[_Union[StepState, str]] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ended_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., message: _Optional[str] = ..., detail: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SwapRecord(_message.Message):
    __slots__ = ("id", "model", "endpoint", "from_version", "to_version", "state", "phase", "error", "started_at", "ended_at", "steps")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    TO_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: str
    endpoint: str
    from_version: int
    to_version: int
    state: SwapState
    phase: SwapPhase
    error: str
    started_at: _timestamp_pb2.Timestamp
    ended_at: _timestamp_pb2.Timestamp
    steps: _containers.RepeatedCompositeFieldContainer[SwapStep]
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., endpoint: _Optional[str] = ..., from_version: _Optional[int] = ..., to_version: _Optional[int] = ..., state: _Optional[_Union[SwapState, str]] = ..., phase: _Optional[_Union[SwapPhase, str]] = ..., error: _Optional[str] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ended_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., steps: _Optional[_Iterable[_Union[SwapStep, _Mapping]]] = ...) -> None: ...

class SwapModelResponse(_message.Message):
    __slots__ = ("swap_id", "phase", "state", "message", "progress", "at", "swap")
    SWAP_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    SWAP_FIELD_NUMBER: _ClassVar[int]
    swap_id: str
    phase: SwapPhase
    state: StepState
    message: str
    progress: float
    at: _timestamp_pb2.Timestamp
    swap: SwapRecord
    def __init__(self, swap_id: _Optional[str] = ..., phase: _Optional[_Union[SwapPhase, str]] = ..., state: _Optional[_Union[StepState, str]] = ..., message: _Optional[str] = ..., progress: _Optional[float] = ..., at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., swap: _Optional[_Union[SwapRecord, _Mapping]] = ...) -> None: ...

class GetSwapRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class GetSwapResponse(_message.Message):
    __slots__ = ("swap",)
    SWAP_FIELD_NUMBER: _ClassVar[int]
    swap: SwapRecord
    def __init__(self, swap: _Optional[_Union[SwapRecord, _Mapping]] = ...) -> None: ...

class ListSwapsRequest(_message.Message):
    __slots__ = ("model", "page_size", "page_token", "read_mask")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    READ_MASK_FIELD_NUMBER: _ClassVar[int]
    model: str
    page_size: int
    page_token: str
    read_mask: _field_mask_pb2.FieldMask
    def __init__(self, model: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., read_mask: _Optional[_Union[_field_mask_pb2.FieldMask, _Mapping]] = ...) -> None: ...

class ListSwapsResponse(_message.Message):
    __slots__ = ("swaps", "next_page_token")
    SWAPS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    swaps: _containers.RepeatedCompositeFieldContainer[SwapRecord]
    next_page_token: str
    def __init__(self, swaps: _Optional[_Iterable[_Union[SwapRecord, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class Pipeline(_message.Message):
    __slots__ = ("name", "yaml")
    NAME_FIELD_NUMBER: _ClassVar[int]
    YAML_FIELD_NUMBER: _ClassVar[int]
    name: str
    yaml: str
    def __init__(self, name: _Optional[str] = ..., yaml: _Optional[str] = ...) -> None: ...

class ApplyPipelineRequest(_message.Message):
    __slots__ = ("yaml", "source")
    YAML_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    yaml: str
    source: str
    def __init__(self, yaml: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class ApplyPipelineResponse(_message.Message):
    __slots__ = ("pipeline",)
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    pipeline: Pipeline
    def __init__(self, pipeline: _Optional[_Union[Pipeline, _Mapping]] = ...) -> None: ...

class GetPipelineRequest(_message.Message):
    __slots__ = ("name", "read_mask")
    NAME_FIELD_NUMBER: _ClassVar[int]
    READ_MASK_FIELD_NUMBER: _ClassVar[int]
    name: str
    read_mask: _field_mask_pb2.FieldMask
    def __init__(self, name: _Optional[str] = ..., read_mask: _Optional[_Union[_field_mask_pb2.FieldMask, _Mapping]] = ...) -> None: ...

class GetPipelineResponse(_message.Message):
    __slots__ = ("pipeline",)
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    pipeline: Pipeline
    def __init__(self, pipeline: _Optional[_Union[Pipeline, _Mapping]] = ...) -> None: ...

class ListPipelinesRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "read_mask")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    READ_MASK_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    read_mask: _field_mask_pb2.FieldMask
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., read_mask: _Optional[_Union[_field_mask_pb2.FieldMask, _Mapping]] = ...) -> None: ...

class ListPipelinesResponse(_message.Message):
    __slots__ = ("pipelines", "next_page_token")
    PIPELINES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    pipelines: _containers.RepeatedCompositeFieldContainer[Pipeline]
    next_page_token: str
    def __init__(self, pipelines: _Optional[_Iterable[_Union[Pipeline, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DeletePipelineRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeletePipelineResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLatencyChainRequest(_message.Message):
    __slots__ = ("pipeline", "window")
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    pipeline: str
    window: str
    def __init__(self, pipeline: _Optional[str] = ..., window: _Optional[str] = ...) -> None: ...

class GetLatencyChainResponse(_message.Message):
    __slots__ = ("chain",)
    CHAIN_FIELD_NUMBER: _ClassVar[int]
    chain: LatencyChain
    def __init__(self, chain: _Optional[_Union[LatencyChain, _Mapping]] = ...) -> None: ...

class StageLatencyReport(_message.Message):
    __slots__ = ("name", "p50_ms", "p90_ms", "p99_ms", "ttfb_p99_ms", "total_p99_ms", "attributed_ms", "share_of_e2e_p99", "queue_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "token_streams", "output_tokens", "stalls", "ttft_attributed_ms", "ttft_share", "stall_max_ms")
    NAME_FIELD_NUMBER: _ClassVar[int]
    P50_MS_FIELD_NUMBER: _ClassVar[int]
    P90_MS_FIELD_NUMBER: _ClassVar[int]
    P99_MS_FIELD_NUMBER: _ClassVar[int]
    TTFB_P99_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_P99_MS_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTED_MS_FIELD_NUMBER: _ClassVar[int]
    SHARE_OF_E2E_P99_FIELD_NUMBER: _ClassVar[int]
    QUEUE_P99_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P50_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P99_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_P50_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_P99_MS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STREAMS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STALLS_FIELD_NUMBER: _ClassVar[int]
    TTFT_ATTRIBUTED_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_SHARE_FIELD_NUMBER: _ClassVar[int]
    STALL_MAX_MS_FIELD_NUMBER: _ClassVar[int]
    name: str
    p50_ms: float
    p90_ms: float
    p99_ms: float
    ttfb_p99_ms: float
    total_p99_ms: float
    attributed_ms: float
    share_of_e2e_p99: float
    queue_p99_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    token_streams: int
    output_tokens: int
    stalls: int
    ttft_attributed_ms: float
    ttft_share: float
    stall_max_ms: float
    def __init__(self, name: _Optional[str] = ..., p50_ms: _Optional[float] = ..., p90_ms: _Optional[float] = ..., p99_ms: _Optional[float] = ..., ttfb_p99_ms: _Optional[float] = ..., total_p99_ms: _Optional[float] = ..., attributed_ms: _Optional[float] = ..., share_of_e2e_p99: _Optional[float] = ..., queue_p99_ms: _Optional[float] = ..., ttft_p50_ms: _Optional[float] = ..., ttft_p99_ms: _Optional[float] = ..., tpot_p50_ms: _Optional[float] = ..., tpot_p99_ms: _Optional[float] = ..., token_streams: _Optional[int] = ..., output_tokens: _Optional[int] = ..., stalls: _Optional[int] = ..., ttft_attributed_ms: _Optional[float] = ..., ttft_share: _Optional[float] = ..., stall_max_ms: _Optional[float] = ...) -> None: ...

class LatencyChain(_message.Message):
    __slots__ = ("pipeline", "window", "chains", "incomplete", "e2e_p50_ms", "e2e_p99_ms", "stages", "bottleneck", "failed", "slowest", "histograms", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "ttft_owner", "token_chains", "token_reports_dropped")
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    CHAINS_FIELD_NUMBER: _ClassVar[int]
    INCOMPLETE_FIELD_NUMBER: _ClassVar[int]
    E2E_P50_MS_FIELD_NUMBER: _ClassVar[int]
    E2E_P99_MS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    BOTTLENECK_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    SLOWEST_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAMS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P50_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P99_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_P50_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_P99_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_OWNER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CHAINS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_REPORTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    pipeline: str
    window: str
    chains: int
    incomplete: int
    e2e_p50_ms: float
    e2e_p99_ms: float
    stages: _containers.RepeatedCompositeFieldContainer[StageLatencyReport]
    bottleneck: str
    failed: int
    slowest: _containers.RepeatedCompositeFieldContainer[SlowChain]
    histograms: _containers.RepeatedCompositeFieldContainer[StageHistogram]
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    ttft_owner: str
    token_chains: int
    token_reports_dropped: int
    def __init__(self, pipeline: _Optional[str] = ..., window: _Optional[str] = ..., chains: _Optional[int] = ..., incomplete: _Optional[int] = ..., e2e_p50_ms: _Optional[float] = ..., e2e_p99_ms: _Optional[float] = ..., stages: _Optional[_Iterable[_Union[StageLatencyReport, _Mapping]]] = ..., bottleneck: _Optional[str] = ..., failed: _Optional[int] = ..., slowest: _Optional[_Iterable[_Union[SlowChain, _Mapping]]] = ..., histograms: _Optional[_Iterable[_Union[StageHistogram, _Mapping]]] = ..., ttft_p50_ms: _Optional[float] = ..., ttft_p99_ms: _Optional[float] = ..., itl_p50_ms: _Optional[float] = ..., itl_p99_ms: _Optional[float] = ..., ttft_owner: _Optional[str] = ..., token_chains: _Optional[int] = ..., token_reports_dropped: _Optional[int] = ...) -> None: ...

class SlowChain(_message.Message):
    __slots__ = ("request_id", "trace_id", "e2e_ms", "stages", "failed", "ttft_ms", "ttft_owner")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    E2E_MS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_OWNER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    trace_id: str
    e2e_ms: float
    stages: _containers.RepeatedCompositeFieldContainer[SlowChainStage]
    failed: bool
    ttft_ms: float
    ttft_owner: str
    def __init__(self, request_id: _Optional[str] = ..., trace_id: _Optional[str] = ..., e2e_ms: _Optional[float] = ..., stages: _Optional[_Iterable[_Union[SlowChainStage, _Mapping]]] = ..., failed: _Optional[bool] = ..., ttft_ms: _Optional[float] = ..., ttft_owner: _Optional[str] = ...) -> None: ...

class SlowChainStage(_message.Message):
    __slots__ = ("name", "offset_ms", "own_ms", "total_ms", "stream", "ttft_part_ms")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_MS_FIELD_NUMBER: _ClassVar[int]
    OWN_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    TTFT_PART_MS_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset_ms: float
    own_ms: float
    total_ms: float
    stream: StageStream
    ttft_part_ms: float
    def __init__(self, name: _Optional[str] = ..., offset_ms: _Optional[float] = ..., own_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., stream: _Optional[_Union[StageStream, _Mapping]] = ..., ttft_part_ms: _Optional[float] = ...) -> None: ...

class StageStream(_message.Message):
    __slots__ = ("ttft_ms", "itl_p50_ms", "itl_p99_ms", "output_tokens", "tokens_per_s", "stalls", "stall_count", "end")
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_P50_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_P99_MS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    STALLS_FIELD_NUMBER: _ClassVar[int]
    STALL_COUNT_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    ttft_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    output_tokens: int
    tokens_per_s: float
    stalls: _containers.RepeatedCompositeFieldContainer[TokenStall]
    stall_count: int
    end: str
    def __init__(self, ttft_ms: _Optional[float] = ..., itl_p50_ms: _Optional[float] = ..., itl_p99_ms: _Optional[float] = ..., output_tokens: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., stalls: _Optional[_Iterable[_Union[TokenStall, _Mapping]]] = ..., stall_count: _Optional[int] = ..., end: _Optional[str] = ...) -> None: ...

class TokenStall(_message.Message):
    __slots__ = ("after_ms", "length_ms")
    AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_MS_FIELD_NUMBER: _ClassVar[int]
    after_ms: float
    length_ms: float
    def __init__(self, after_ms: _Optional[float] = ..., length_ms: _Optional[float] = ...) -> None: ...

class StageHistogram(_message.Message):
    __slots__ = ("name", "buckets")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    name: str
    buckets: _containers.RepeatedCompositeFieldContainer[HistogramBucket]
    def __init__(self, name: _Optional[str] = ..., buckets: _Optional[_Iterable[_Union[HistogramBucket, _Mapping]]] = ...) -> None: ...

class HistogramBucket(_message.Message):
    __slots__ = ("le_ms", "count")
    LE_MS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    le_ms: float
    count: int
    def __init__(self, le_ms: _Optional[float] = ..., count: _Optional[int] = ...) -> None: ...

class ReportStageLatencyRequest(_message.Message):
    __slots__ = ("request_id", "pipeline", "stage", "start", "end", "first_byte", "traceparent", "first_token", "output_tokens", "time_per_output_token_ms", "stalls")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    FIRST_BYTE_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIME_PER_OUTPUT_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    STALLS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    pipeline: str
    stage: str
    start: _timestamp_pb2.Timestamp
    end: _timestamp_pb2.Timestamp
    first_byte: _timestamp_pb2.Timestamp
    traceparent: str
    first_token: _timestamp_pb2.Timestamp
    output_tokens: int
    time_per_output_token_ms: float
    stalls: int
    def __init__(self, request_id: _Optional[str] = ..., pipeline: _Optional[str] = ..., stage: _Optional[str] = ..., start: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., first_byte: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., traceparent: _Optional[str] = ..., first_token: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., output_tokens: _Optional[int] = ..., time_per_output_token_ms: _Optional[float] = ..., stalls: _Optional[int] = ...) -> None: ...

class ReportStageLatencyResponse(_message.Message):
    __slots__ = ("accepted", "rejected")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    rejected: int
    def __init__(self, accepted: _Optional[int] = ..., rejected: _Optional[int] = ...) -> None: ...

class Tenant(_message.Message):
    __slots__ = ("name", "models", "priority", "max_priority", "max_concurrency", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MAX_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    name: str
    models: _containers.RepeatedScalarFieldContainer[str]
    priority: int
    max_priority: int
    max_concurrency: int
    labels: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., priority: _Optional[int] = ..., max_priority: _Optional[int] = ..., max_concurrency: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CreateTenantRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: Tenant
    def __init__(self, tenant: _Optional[_Union[Tenant, _Mapping]] = ...) -> None: ...

class CreateTenantResponse(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: Tenant
    def __init__(self, tenant: _Optional[_Union[Tenant, _Mapping]] = ...) -> None: ...

class UpdateTenantRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: Tenant
    def __init__(self, tenant: _Optional[_Union[Tenant, _Mapping]] = ...) -> None: ...

class UpdateTenantResponse(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: Tenant
    def __init__(self, tenant: _Optional[_Union[Tenant, _Mapping]] = ...) -> None: ...

class GetTenantRequest(_message.Message):
    __slots__ = ("name", "read_mask")
    NAME_FIELD_NUMBER: _ClassVar[int]
    READ_MASK_FIELD_NUMBER: _ClassVar[int]
    name: str
    read_mask: _field_mask_pb2.FieldMask
    def __init__(self, name: _Optional[str] = ..., read_mask: _Optional[_Union[_field_mask_pb2.FieldMask, _Mapping]] = ...) -> None: ...

class GetTenantResponse(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: Tenant
    def __init__(self, tenant: _Optional[_Union[Tenant, _Mapping]] = ...) -> None: ...

class ListTenantsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "read_mask")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    READ_MASK_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    read_mask: _field_mask_pb2.FieldMask
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., read_mask: _Optional[_Union[_field_mask_pb2.FieldMask, _Mapping]] = ...) -> None: ...

class ListTenantsResponse(_message.Message):
    __slots__ = ("tenants", "next_page_token")
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[Tenant]
    next_page_token: str
    def __init__(self, tenants: _Optional[_Iterable[_Union[Tenant, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DeleteTenantRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteTenantResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ApiKey(_message.Message):
    __slots__ = ("id", "tenant", "name", "created_at", "expires_at", "revoked")
    ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    id: str
    tenant: str
    name: str
    created_at: _timestamp_pb2.Timestamp
    expires_at: _timestamp_pb2.Timestamp
    revoked: bool
    def __init__(self, id: _Optional[str] = ..., tenant: _Optional[str] = ..., name: _Optional[str] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., revoked: _Optional[bool] = ...) -> None: ...

class CreateApiKeyRequest(_message.Message):
    __slots__ = ("tenant", "name", "expires_at")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    name: str
    expires_at: _timestamp_pb2.Timestamp
    def __init__(self, tenant: _Optional[str] = ..., name: _Optional[str] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class CreateApiKeyResponse(_message.Message):
    __slots__ = ("key", "secret")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    key: ApiKey
    secret: str
    def __init__(self, key: _Optional[_Union[ApiKey, _Mapping]] = ..., secret: _Optional[str] = ...) -> None: ...

class ListApiKeysRequest(_message.Message):
    __slots__ = ("tenant", "page_size", "page_token", "read_mask")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    READ_MASK_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    page_size: int
    page_token: str
    read_mask: _field_mask_pb2.FieldMask
    def __init__(self, tenant: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., read_mask: _Optional[_Union[_field_mask_pb2.FieldMask, _Mapping]] = ...) -> None: ...

class ListApiKeysResponse(_message.Message):
    __slots__ = ("keys", "next_page_token")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[ApiKey]
    next_page_token: str
    def __init__(self, keys: _Optional[_Iterable[_Union[ApiKey, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class RevokeApiKeyRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class RevokeApiKeyResponse(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: ApiKey
    def __init__(self, key: _Optional[_Union[ApiKey, _Mapping]] = ...) -> None: ...

class GetTokenUsageRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class TokenUsage(_message.Message):
    __slots__ = ("limit_index", "per", "each", "tokens", "models", "subject", "used", "remaining", "reset_s")
    LIMIT_INDEX_FIELD_NUMBER: _ClassVar[int]
    PER_FIELD_NUMBER: _ClassVar[int]
    EACH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    REMAINING_FIELD_NUMBER: _ClassVar[int]
    RESET_S_FIELD_NUMBER: _ClassVar[int]
    limit_index: int
    per: str
    each: str
    tokens: int
    models: _containers.RepeatedScalarFieldContainer[str]
    subject: str
    used: int
    remaining: int
    reset_s: float
    def __init__(self, limit_index: _Optional[int] = ..., per: _Optional[str] = ..., each: _Optional[str] = ..., tokens: _Optional[int] = ..., models: _Optional[_Iterable[str]] = ..., subject: _Optional[str] = ..., used: _Optional[int] = ..., remaining: _Optional[int] = ..., reset_s: _Optional[float] = ...) -> None: ...

class GetTokenUsageResponse(_message.Message):
    __slots__ = ("tenant", "usage", "truncated")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    usage: _containers.RepeatedCompositeFieldContainer[TokenUsage]
    truncated: bool
    def __init__(self, tenant: _Optional[str] = ..., usage: _Optional[_Iterable[_Union[TokenUsage, _Mapping]]] = ..., truncated: _Optional[bool] = ...) -> None: ...

class RateLimitConfigFile(_message.Message):
    __slots__ = ("name", "yaml")
    NAME_FIELD_NUMBER: _ClassVar[int]
    YAML_FIELD_NUMBER: _ClassVar[int]
    name: str
    yaml: str
    def __init__(self, name: _Optional[str] = ..., yaml: _Optional[str] = ...) -> None: ...

class ApplyRateLimitConfigRequest(_message.Message):
    __slots__ = ("files", "dry_run")
    FILES_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[RateLimitConfigFile]
    dry_run: bool
    def __init__(self, files: _Optional[_Iterable[_Union[RateLimitConfigFile, _Mapping]]] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class ApplyRateLimitConfigResponse(_message.Message):
    __slots__ = ("domains", "config_version", "applied")
    DOMAINS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_VERSION_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    domains: _containers.RepeatedScalarFieldContainer[str]
    config_version: str
    applied: bool
    def __init__(self, domains: _Optional[_Iterable[str]] = ..., config_version: _Optional[str] = ..., applied: _Optional[bool] = ...) -> None: ...

class GetRateLimitConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RateLimitDomain(_message.Message):
    __slots__ = ("domain", "source", "yaml")
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    YAML_FIELD_NUMBER: _ClassVar[int]
    domain: str
    source: str
    yaml: str
    def __init__(self, domain: _Optional[str] = ..., source: _Optional[str] = ..., yaml: _Optional[str] = ...) -> None: ...

class GetRateLimitConfigResponse(_message.Message):
    __slots__ = ("domains", "config_version")
    DOMAINS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_VERSION_FIELD_NUMBER: _ClassVar[int]
    domains: _containers.RepeatedCompositeFieldContainer[RateLimitDomain]
    config_version: str
    def __init__(self, domains: _Optional[_Iterable[_Union[RateLimitDomain, _Mapping]]] = ..., config_version: _Optional[str] = ...) -> None: ...

class DeleteRateLimitConfigRequest(_message.Message):
    __slots__ = ("domain",)
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    domain: str
    def __init__(self, domain: _Optional[str] = ...) -> None: ...

class DeleteRateLimitConfigResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceStatus(_message.Message):
    __slots__ = ("name", "server", "state")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SERVER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    server: Listener
    state: ServingState
    def __init__(self, name: _Optional[str] = ..., server: _Optional[_Union[Listener, str]] = ..., state: _Optional[_Union[ServingState, str]] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("index", "pid", "alive", "restarts")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    pid: int
    alive: bool
    restarts: int
    def __init__(self, index: _Optional[int] = ..., pid: _Optional[int] = ..., alive: _Optional[bool] = ..., restarts: _Optional[int] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("version", "uptime_seconds", "started_at", "services", "config_version", "state_revision", "data_addr", "admin_addr", "metrics_addr", "workers")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    SERVICES_FIELD_NUMBER: _ClassVar[int]
    CONFIG_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_REVISION_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDR_FIELD_NUMBER: _ClassVar[int]
    ADMIN_ADDR_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDR_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    version: str
    uptime_seconds: float
    started_at: _timestamp_pb2.Timestamp
    services: _containers.RepeatedCompositeFieldContainer[ServiceStatus]
    config_version: str
    state_revision: int
    data_addr: str
    admin_addr: str
    metrics_addr: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    def __init__(self, version: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., services: _Optional[_Iterable[_Union[ServiceStatus, _Mapping]]] = ..., config_version: _Optional[str] = ..., state_revision: _Optional[int] = ..., data_addr: _Optional[str] = ..., admin_addr: _Optional[str] = ..., metrics_addr: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ...) -> None: ...
