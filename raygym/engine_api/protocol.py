"""The engine protocol: SGLang's native HTTP API as raygym speaks it, in one place.

Endpoint paths, the request bodies and the answers, as pydantic models with the field names, types and
defaults of SGLang's ``srt/managers/io_struct.py`` (checked against SGLang 0.5.6, 0.5.15.post1, 0.5.18
and 0.5.23), and :data:`ROUTES`, which names each route's method, request and answer. raygym's servers
(:mod:`raygym.engines.raygym_server.server`, :mod:`raygym.engines.vllm.server`) validate requests with these models; the
one engine client (:mod:`raygym.engine_api.client`: the rollout manager, the EngineActor, the weight sync, the
judge, ``raygym serve``) builds every request from them and parses every answer with them, so no side can
drift from the other. Pure: pydantic only. It sits below ``raygym.rollout`` and ``raygym.weightsync``,
which both speak it (``raygym.engine_api.protocol`` re-exports it).

Requests: top-level fields a model does not know are ignored, as SGLang's server ignores them; wrong types
are errors naming the field (``master_port`` may arrive as a string, as SGLang's own tests send it, and is
converted). Answers: read leniently and kept whole (fields a model does not name stay on it, as SGLang adds
fields from release to release). raygym's extensions live under ``/raygym/``.

Streaming (``"stream": true`` on ``/generate``, SGLang's form): server-sent events, one ``data: <json>``
frame per update, each a whole :class:`GenerateResponse` so far (cumulative ``text``, ``output_ids`` and
``meta_info``; ``finish_reason`` null until the last; ``index`` = the row of a batch), then ``data: [DONE]``.

>>> InitWeightsUpdateGroup.model_validate({"master_address": "10.0.0.1", "master_port": "29500",
...     "rank_offset": 1, "world_size": 2}).master_port
29500
>>> Endpoint.UPDATE_WEIGHTS_FROM_DISTRIBUTED.value
'/update_weights_from_distributed'
>>> ROUTES[Endpoint.PAUSE_GENERATION].request.__name__, ROUTES[Endpoint.PAUSE_GENERATION].method
('PauseGeneration', 'POST')
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class Endpoint(str, enum.Enum):
    """Every route raygym sends to or serves. Values are URL paths."""

    GENERATE = "/generate"
    HEALTH = "/health"
    HEALTH_GENERATE = "/health_generate"
    MODEL_INFO = "/model_info"
    GET_MODEL_INFO = "/get_model_info"  # deprecated in SGLang for /model_info; still served
    SERVER_INFO = "/server_info"
    GET_SERVER_INFO = "/get_server_info"  # deprecated in SGLang for /server_info; still served
    PING = "/ping"
    FLUSH_CACHE = "/flush_cache"
    PAUSE_GENERATION = "/pause_generation"
    CONTINUE_GENERATION = "/continue_generation"
    ABORT_REQUEST = "/abort_request"
    RELEASE_MEMORY = "/release_memory_occupation"
    RESUME_MEMORY = "/resume_memory_occupation"
    UPDATE_WEIGHTS_FROM_DISK = "/update_weights_from_disk"
    UPDATE_WEIGHTS_FROM_TENSOR = "/update_weights_from_tensor"
    INIT_WEIGHTS_UPDATE_GROUP = "/init_weights_update_group"
    UPDATE_WEIGHTS_FROM_DISTRIBUTED = "/update_weights_from_distributed"
    DESTROY_WEIGHTS_UPDATE_GROUP = "/destroy_weights_update_group"
    BEGIN_WEIGHT_UPDATE = "/begin_weight_update"  # SGLang >= 0.5.23: a session around every update
    END_WEIGHT_UPDATE = "/end_weight_update"
    UPDATE_WEIGHT_VERSION = "/update_weight_version"
    GET_WEIGHT_VERSION = "/get_weight_version"  # SGLang 0.5.6-0.5.18 (also as /weight_version)
    WEIGHT_VERSION = "/weight_version"
    GET_WEIGHTS_BY_NAME = "/get_weights_by_name"
    WEIGHTS_CHECKER = "/weights_checker"
    LOAD_LORA_ADAPTER = "/load_lora_adapter"  # LoRA runs on SGLang and vLLM (raygym.weightsync.adapter)
    UNLOAD_LORA_ADAPTER = "/unload_lora_adapter"
    RAYGYM_WEIGHTS_CHECKSUM = "/raygym/weights_checksum"
    RAYGYM_STATS = "/raygym/stats"
    RAYGYM_SHADOW_BEGIN = "/raygym/shadow_begin"  # double-buffered updates (raygym's server)
    RAYGYM_SHADOW_SWITCH = "/raygym/shadow_switch"
    RAYGYM_SHADOW_DISCARD = "/raygym/shadow_discard"

    @property
    def name_without_slash(self) -> str:
        """``"update_weights_from_disk"`` (the form :class:`raygym.weightsync.engine_link.EngineLink` takes)."""
        return self.value.lstrip("/")


# Routes that change the engine's state: no browser may drive them (no cross-site request, no body of a type a
# page may send without asking), whatever method SGLang takes on them.
STATE_CHANGING = frozenset({
    Endpoint.FLUSH_CACHE, Endpoint.PAUSE_GENERATION, Endpoint.CONTINUE_GENERATION, Endpoint.ABORT_REQUEST,
    Endpoint.RELEASE_MEMORY, Endpoint.RESUME_MEMORY, Endpoint.UPDATE_WEIGHTS_FROM_DISK,
    Endpoint.UPDATE_WEIGHTS_FROM_TENSOR, Endpoint.INIT_WEIGHTS_UPDATE_GROUP,
    Endpoint.UPDATE_WEIGHTS_FROM_DISTRIBUTED, Endpoint.DESTROY_WEIGHTS_UPDATE_GROUP,
    Endpoint.BEGIN_WEIGHT_UPDATE, Endpoint.END_WEIGHT_UPDATE, Endpoint.UPDATE_WEIGHT_VERSION,
    Endpoint.RAYGYM_SHADOW_BEGIN, Endpoint.RAYGYM_SHADOW_SWITCH, Endpoint.RAYGYM_SHADOW_DISCARD,
    Endpoint.LOAD_LORA_ADAPTER, Endpoint.UNLOAD_LORA_ADAPTER,
})

_GET, _POST, _PUT = frozenset({"GET"}), frozenset({"POST"}), frozenset({"PUT"})
# The HTTP methods stock SGLang serves on each of its routes that raygym speaks: the union over the releases
# the ``sglang`` extra allows (0.5.6-0.5.23, their ``srt/entrypoints/http_server.py``), so a client written
# for any of them works. raygym's servers take exactly these (anything else is a 405), route by route.
SGLANG_ROUTE_METHODS: dict[Endpoint, frozenset[str]] = {
    Endpoint.GENERATE: _POST | _PUT,
    Endpoint.HEALTH: _GET,
    Endpoint.HEALTH_GENERATE: _GET,
    Endpoint.MODEL_INFO: _GET,
    Endpoint.GET_MODEL_INFO: _GET,
    Endpoint.SERVER_INFO: _GET,
    Endpoint.GET_SERVER_INFO: _GET,
    Endpoint.PING: _GET,
    Endpoint.FLUSH_CACHE: _GET | _POST,
    Endpoint.PAUSE_GENERATION: _POST,
    Endpoint.CONTINUE_GENERATION: _POST,
    Endpoint.ABORT_REQUEST: _POST,
    Endpoint.RELEASE_MEMORY: _GET | _POST,
    Endpoint.RESUME_MEMORY: _GET | _POST,
    Endpoint.UPDATE_WEIGHTS_FROM_DISK: _POST,
    Endpoint.UPDATE_WEIGHTS_FROM_TENSOR: _POST,
    Endpoint.INIT_WEIGHTS_UPDATE_GROUP: _POST,
    Endpoint.UPDATE_WEIGHTS_FROM_DISTRIBUTED: _POST,
    Endpoint.DESTROY_WEIGHTS_UPDATE_GROUP: _POST,
    Endpoint.BEGIN_WEIGHT_UPDATE: _POST,
    Endpoint.END_WEIGHT_UPDATE: _POST,
    Endpoint.UPDATE_WEIGHT_VERSION: _POST,
    Endpoint.GET_WEIGHT_VERSION: _GET,
    Endpoint.WEIGHT_VERSION: _GET,
    Endpoint.GET_WEIGHTS_BY_NAME: _GET | _POST,
    Endpoint.WEIGHTS_CHECKER: _GET | _POST,
    Endpoint.LOAD_LORA_ADAPTER: _POST,
    Endpoint.UNLOAD_LORA_ADAPTER: _POST,
}
# raygym's own routes (under /raygym/): reads are GET, everything else POST.
RAYGYM_ROUTE_METHODS: dict[Endpoint, frozenset[str]] = {
    Endpoint.RAYGYM_WEIGHTS_CHECKSUM: _POST,
    Endpoint.RAYGYM_STATS: _GET,
    Endpoint.RAYGYM_SHADOW_BEGIN: _POST,
    Endpoint.RAYGYM_SHADOW_SWITCH: _POST,
    Endpoint.RAYGYM_SHADOW_DISCARD: _POST,
}


def route_methods(endpoint: Endpoint) -> frozenset[str]:
    """The methods raygym's servers take on ``endpoint`` (SGLang's own where SGLang has the route).

    >>> sorted(route_methods(Endpoint.FLUSH_CACHE))
    ['GET', 'POST']
    >>> sorted(route_methods(Endpoint.GENERATE))
    ['POST', 'PUT']
    """
    return SGLANG_ROUTE_METHODS.get(endpoint) or RAYGYM_ROUTE_METHODS[endpoint]


PAUSE_MODES = ("abort", "in_place", "retract")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
# SGLang's own name for one flat uint8 buffer holding a bucket of tensors back to back
# (``srt/weight_sync/tensor_bucket.py``); the only load_format /update_weights_from_distributed honours.
FLATTENED_BUCKET = "flattened_bucket"


class _Body(BaseModel):
    """Strict types (``"yes"`` is not a bool, ``1.5`` not an int), as SGLang's msgspec decoding; unknown
    fields are ignored, as SGLang's server ignores them."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)


class GenerateRequest(_Body):
    """``POST /generate``: one prompt or a batch (lists), as ``input_ids`` or ``text``."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    stream: bool = False
    lora_path: str | list[str | None] | None = None  # the LoRA adapter to generate with, by its loaded name
    return_routed_experts: bool | list[bool] | None = None  # MoE: meta_info.routed_experts (raygym/routed_experts.py)
    # SGLang's: one prompt's images (a list, or one), or a batch's (a list per prompt); each a path, URL,
    # base64 or data URL (raygym sends PNG data URLs: raygym/vision/images.py)
    image_data: str | list[str] | list[list[str]] | None = None


class PauseGeneration(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGeneration(_Body):
    torch_empty_cache: bool = True


class LoadLoRAAdapter(_Body):
    """``POST /load_lora_adapter``: load the PEFT adapter directory ``lora_path`` under ``lora_name``."""

    lora_name: str
    lora_path: str
    pinned: bool = False


class UnloadLoRAAdapter(_Body):
    lora_name: str


class AbortRequest(_Body):
    rid: str | None = ""
    abort_all: bool = False


class MemoryTags(_Body):
    """``/release_memory_occupation`` and ``/resume_memory_occupation``; None = every tag."""

    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = None


class _WeightUpdate(_Body):
    """Fields every weight-loading request shares. An int ``weight_version`` is taken as its text."""

    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None

    @field_validator("weight_version", mode="before")
    @classmethod
    def _version_as_text(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v


class UpdateWeightsFromDisk(_WeightUpdate):
    model_path: str


class UpdateWeightsFromTensor(_WeightUpdate):
    """``serialized_named_tensors``: one base64 pickle of ``[(name, tensor), ...]`` per TP rank."""

    serialized_named_tensors: list[str]


class InitWeightsUpdateGroup(_Body):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=0)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["nccl", "gloo"] = "nccl"

    @field_validator("master_port", mode="before")
    @classmethod
    def _port_as_number(cls, v: Any) -> Any:
        """SGLang's own tests send the port as a string."""
        return int(v) if isinstance(v, str) and v.strip().isdigit() else v


class UpdateWeightsFromDistributed(_WeightUpdate):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"


class DestroyWeightsUpdateGroup(_Body):
    group_name: str = "weight_update_group"


class BeginWeightUpdate(_Body):
    selector: Literal["target", "draft", "all"] = "all"


class WeightsChecksum(_Body):
    """raygym extension: ``{"names": [...] | None, "shadow": false}`` -> :class:`WeightsChecksumResponse`
    (``shadow``: of the copy a double-buffered update is loading, not of the served weights)."""

    names: list[str] | None = None
    shadow: bool = False


class ShadowBegin(_Body):
    """raygym extension: the following weight updates load into a shadow copy while the model serves;
    ``full``: the update rewrites every tensor it sends (no need to copy the served weights first)."""

    full: bool = False


class ShadowSwitch(_Body):
    """raygym extension: serve the shadow copy (between two forward passes) under ``weight_version``
    (default: the version its updates carried); ``abort_all_requests`` aborts what is in flight first."""

    weight_version: str | None = None
    abort_all_requests: bool = False

    @field_validator("weight_version", mode="before")
    @classmethod
    def _version_as_text(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v


class UpdateWeightVersion(_Body):
    """``POST /update_weight_version``: label the served weights ``new_version`` (SGLang aborts what is in flight
    first unless ``abort_all_requests`` is false)."""

    new_version: str = Field(min_length=1)
    abort_all_requests: bool = True

    @field_validator("new_version", mode="before")
    @classmethod
    def _version_as_text(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v


class NoFields(_Body):
    """A body of no fields (``{}``): routes that take POST with nothing to say."""


# --------------------------------------------------------------------------- answers


class _Answer(BaseModel):
    """An engine's answer: read leniently (``1`` is a fine float, a number a fine weight version) and kept whole,
    fields this model does not name included (SGLang adds fields from release to release; they stay readable
    as attributes)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    @field_validator("weight_version", mode="before", check_fields=False)
    @classmethod
    def _version_as_text(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v

    def __getitem__(self, key: str) -> Any:
        """A field by its JSON name, as the JSON reads (``answer["meta_info"]["finish_reason"]["type"]``)."""
        if key in type(self).model_fields or key in (self.__pydantic_extra__ or {}):
            return getattr(self, key)
        raise KeyError(key)

    def get(self, key: str, default: Any = None) -> Any:
        """``answer[key]``, or ``default`` when the answer has no such field."""
        try:
            return self[key]
        except KeyError:
            return default


class FinishReason(_Answer):
    """Why a sample ended: ``length`` (``length`` tokens), ``stop`` (``matched`` token id or string) or
    ``abort`` (``message``; the engine paused, was asked to, or refused)."""

    type: Literal["length", "stop", "abort"]
    length: int | None = None
    matched: int | str | None = None
    message: str | None = None


class GenerateMetaInfo(_Answer):
    """What RL clients read from ``meta_info`` (slime, verl, raygym's manager)."""

    id: str
    finish_reason: FinishReason | None  # None: a stream chunk of a sample still running
    prompt_tokens: int = 0  # SGLang leaves it out of a request it aborted (a pause, its waiting queue)
    completion_tokens: int = 0
    cached_tokens: int = 0
    weight_version: str | None = None
    output_token_logprobs: list[list[Any]] | None = None  # [logprob, token_id, text | None]
    output_token_weight_versions: list[str] | None = None  # raygym: the weight version of each output token
    input_token_logprobs: list[list[Any]] | None = None  # first entry's logprob is None
    e2e_latency: float | None = None
    routed_experts: str | None = None  # MoE, when asked: base64 int32 [tokens - 1, layers, top_k] (SGLang's form)


class GenerateResponse(_Answer):
    """One sample's answer to ``/generate`` (a batch answers a list of them, one per prompt and sample). As a
    stream chunk: the sample so far, ``index`` its row in the batch."""

    text: str
    output_ids: list[int]
    meta_info: GenerateMetaInfo
    index: int | None = None

    @property
    def finish_type(self) -> str:
        """``length`` | ``stop`` | ``abort``, or ``""`` while the sample runs."""
        reason = self.meta_info.finish_reason
        return reason.type if reason is not None else ""

    def tokens_and_logprobs(self) -> tuple[list[int], list[float]]:
        """The generated tokens and, when they were asked for, their log-probs (else ``[]``).

        >>> GenerateResponse.model_validate({"text": "", "output_ids": [5], "meta_info": {"id": "r",
        ...     "finish_reason": None, "prompt_tokens": 1, "completion_tokens": 1,
        ...     "output_token_logprobs": [[-0.5, 5, None]]}}).tokens_and_logprobs()
        ([5], [-0.5])
        """
        entries = self.meta_info.output_token_logprobs
        if entries:
            return [int(e[1]) for e in entries], [float(e[0]) for e in entries]
        return list(self.output_ids), []


class StatusAnswer(_Answer):
    """``/pause_generation``, ``/continue_generation``: ``{"message", "status"}`` (or SGLang's older empty body)."""

    message: str = ""
    status: str = ""


class WeightUpdateResult(_Answer):
    """The answer of every weight route (HTTP 200 on success, 400 otherwise); raygym's receivers add how the
    load went (``apply_s``, ``setup_s``, ``in_place``, ``adopted``; double buffering: ``catch_up_s``,
    ``switch_s``)."""

    success: bool
    message: str = ""
    num_paused_requests: int | None = None
    apply_s: float = 0.0
    setup_s: float = 0.0
    in_place: bool = False
    adopted: bool = False
    catch_up_s: float = 0.0
    switch_s: float = 0.0


class WeightsChecksumResponse(_Answer):
    weight_version: str | None
    checksums: dict[str, str]


class ModelInfo(_Answer):
    """``GET /model_info`` fields RL clients read (slime reads the multimodal flags; raygym's vLLM adapter adds
    the ``dtype`` it runs the weights in, which the sender casts to)."""

    model_path: str
    tokenizer_path: str | None = None
    is_generation: bool = True
    weight_version: str | None = None
    has_image_understanding: bool = False
    has_audio_understanding: bool = False
    dtype: str | None = None


class WeightVersionAnswer(_Answer):
    weight_version: str | None = None


class LoraAnswer(_Answer):
    """``/load_lora_adapter``, ``/unload_lora_adapter``: ``loaded_adapters`` name -> path."""

    success: bool
    message: str = ""
    error_message: str = ""
    loaded_adapters: dict[str, Any] = Field(default_factory=dict)


class EngineStats(_Answer):
    """raygym's ``GET /raygym/stats``: batching counters (raygym's server) or requests in flight (vLLM adapter)."""

    weight_version: str | None = None
    paused: bool | str | None = None
    released: list[str] = Field(default_factory=list)


# --------------------------------------------------------------------------- routes


@dataclass(frozen=True)
class Route:
    """How a client speaks one endpoint: its HTTP method, the request model (None: no body) and the answer model
    (None: the body carries nothing to read, e.g. ``/flush_cache``'s text)."""

    method: str
    request: type[_Body] | None
    answer: type[_Answer] | None


_W = WeightUpdateResult
# The routes raygym's clients send, each once. Methods are the one raygym uses of those SGLang takes.
ROUTES: dict[Endpoint, Route] = {
    Endpoint.GENERATE: Route("POST", GenerateRequest, GenerateResponse),
    Endpoint.HEALTH: Route("GET", None, None),
    Endpoint.HEALTH_GENERATE: Route("GET", None, None),
    Endpoint.MODEL_INFO: Route("GET", None, ModelInfo),
    Endpoint.GET_MODEL_INFO: Route("GET", None, ModelInfo),
    Endpoint.GET_WEIGHT_VERSION: Route("GET", None, WeightVersionAnswer),
    Endpoint.WEIGHT_VERSION: Route("GET", None, WeightVersionAnswer),
    Endpoint.FLUSH_CACHE: Route("POST", None, None),
    Endpoint.PAUSE_GENERATION: Route("POST", PauseGeneration, StatusAnswer),
    Endpoint.CONTINUE_GENERATION: Route("POST", ContinueGeneration, StatusAnswer),
    Endpoint.ABORT_REQUEST: Route("POST", AbortRequest, None),
    Endpoint.RELEASE_MEMORY: Route("POST", MemoryTags, None),
    Endpoint.RESUME_MEMORY: Route("POST", MemoryTags, None),
    Endpoint.UPDATE_WEIGHTS_FROM_DISK: Route("POST", UpdateWeightsFromDisk, _W),
    Endpoint.UPDATE_WEIGHTS_FROM_TENSOR: Route("POST", UpdateWeightsFromTensor, _W),
    Endpoint.INIT_WEIGHTS_UPDATE_GROUP: Route("POST", InitWeightsUpdateGroup, _W),
    Endpoint.UPDATE_WEIGHTS_FROM_DISTRIBUTED: Route("POST", UpdateWeightsFromDistributed, _W),
    Endpoint.DESTROY_WEIGHTS_UPDATE_GROUP: Route("POST", DestroyWeightsUpdateGroup, _W),
    Endpoint.BEGIN_WEIGHT_UPDATE: Route("POST", BeginWeightUpdate, _W),
    Endpoint.END_WEIGHT_UPDATE: Route("POST", NoFields, _W),
    Endpoint.UPDATE_WEIGHT_VERSION: Route("POST", UpdateWeightVersion, _W),
    Endpoint.LOAD_LORA_ADAPTER: Route("POST", LoadLoRAAdapter, LoraAnswer),
    Endpoint.UNLOAD_LORA_ADAPTER: Route("POST", UnloadLoRAAdapter, LoraAnswer),
    Endpoint.RAYGYM_WEIGHTS_CHECKSUM: Route("POST", WeightsChecksum, WeightsChecksumResponse),
    Endpoint.RAYGYM_STATS: Route("GET", None, EngineStats),
    Endpoint.RAYGYM_SHADOW_BEGIN: Route("POST", ShadowBegin, _W),
    Endpoint.RAYGYM_SHADOW_SWITCH: Route("POST", ShadowSwitch, _W),
    Endpoint.RAYGYM_SHADOW_DISCARD: Route("POST", NoFields, _W),
}


def request_body(endpoint: Endpoint, body: _Body | None) -> _Body | None:
    """``body`` checked against the model ``endpoint`` takes (a client bug otherwise, not the user's).

    >>> request_body(Endpoint.PAUSE_GENERATION, PauseGeneration(mode="in_place")).mode
    'in_place'
    """
    route = ROUTES[endpoint]
    if route.request is None:
        assert body is None, f"{endpoint.value} takes no body, got {type(body).__name__}"
        return None
    body = route.request() if body is None else body
    assert isinstance(body, route.request), f"{endpoint.value} takes {route.request.__name__}, got {type(body).__name__}"
    return body


def body_json(body: _Body) -> bytes:
    """The JSON a request carries: the fields the caller set (the rest are the engine's defaults).

    >>> body_json(PauseGeneration(mode="abort")), body_json(NoFields())
    (b'{"mode":"abort"}', b'{}')
    """
    return body.model_dump_json(exclude_unset=True).encode()


def body_fields(body: _Body | None) -> dict[str, Any]:
    """The fields the caller set, as keyword arguments (for engines in this process or behind a Ray actor)."""
    return {} if body is None else body.model_dump(exclude_unset=True)


# --------------------------------------------------------------------------- streaming

STREAM_DATA = b"data: "
STREAM_DONE = b"data: [DONE]\n\n"


def stream_frame(payload: bytes) -> bytes:
    """One server-sent event carrying ``payload`` (JSON).

    >>> stream_frame(b'{"text": "a"}')
    b'data: {"text": "a"}\\n\\n'
    """
    return STREAM_DATA + payload + b"\n\n"


def stream_payload(line: bytes) -> bytes | None:
    """The JSON of one stream line (``data: ...``), ``b"[DONE]"`` at the end, None for blank lines and comments.

    >>> stream_payload(b'data: {"a": 1}\\n'), stream_payload(b"\\n"), stream_payload(b"data: [DONE]")
    (b'{"a": 1}', None, b'[DONE]')
    """
    line = line.strip()
    if not line.startswith(STREAM_DATA.strip()):
        return None
    return line[len(STREAM_DATA.strip()):].strip()


def request_error(exc: ValidationError, endpoint: str) -> str:
    """One line naming the first bad field of a request body, its value and what it must be.

    >>> try:
    ...     InitWeightsUpdateGroup.model_validate({"master_address": "a", "master_port": "x",
    ...                                            "rank_offset": 0, "world_size": 2})
    ... except ValidationError as e:
    ...     print(request_error(e, "/init_weights_update_group"))
    /init_weights_update_group: master_port='x': Input should be a valid integer
    """
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()))
        if err.get("type") == "missing":
            problems.append(f"missing required field {where!r}")
        else:
            problems.append(f"{where}={err.get('input')!r}: {err.get('msg')}")
    return f"{endpoint}: " + "; ".join(problems[:3])


__all__ = [
    "FLATTENED_BUCKET", "MEMORY_TAGS", "PAUSE_MODES", "RAYGYM_ROUTE_METHODS", "ROUTES", "SGLANG_ROUTE_METHODS",
    "STATE_CHANGING", "STREAM_DATA", "STREAM_DONE", "AbortRequest", "BeginWeightUpdate", "ContinueGeneration",
    "DestroyWeightsUpdateGroup", "Endpoint", "EngineStats", "FinishReason", "GenerateMetaInfo", "GenerateRequest",
    "GenerateResponse", "InitWeightsUpdateGroup", "LoadLoRAAdapter", "LoraAnswer", "MemoryTags", "ModelInfo",
    "NoFields", "PauseGeneration", "Route", "ShadowBegin", "ShadowSwitch", "StatusAnswer", "UnloadLoRAAdapter",
    "UpdateWeightVersion", "UpdateWeightsFromDisk", "UpdateWeightsFromDistributed", "UpdateWeightsFromTensor",
    "WeightUpdateResult", "WeightVersionAnswer", "WeightsChecksum", "WeightsChecksumResponse", "body_fields",
    "body_json", "request_body", "request_error", "route_methods", "stream_frame", "stream_payload",
]
