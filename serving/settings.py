"""Server settings (pydantic-settings): the one edge where the environment and CLI become typed config.

Every field can come from an environment variable ``FEDMOSAIC_SERVE_<FIELD>`` (lists as JSON; keys also
comma-separated), from ``fedmosaic serve`` options (only those given: an option left out never
overrides the environment), or from code (``ServeSettings(model="tiny")``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from adapters.targets import parse_targets
from routing.base import Pooling
from routing.feddpa import Mode, Similarity, Variant, similarity_name
from routing.feddpa_options import OPTION_NAMES, FedDPAOptions, Prefill, Routing, Rule, option_default, option_help
from serving.engine.config import EngineConfig, limit_bound, limit_default, limit_help

Keys = Annotated[list[str], NoDecode]  # from the environment: a JSON list or comma-separated


def _feddpa(name: str, **checks: Any) -> Any:
    """The setting ``feddpa_<name>``: default and description from :class:`FedDPAOptions`, its one definition."""
    return Field(option_default(name), description=option_help(name), **checks)


_DEFAULT = object()  # _engine without a default of the server's own: the engine's


def _engine(name: str, default: Any = _DEFAULT, unset: str | None = None, **checks: Any) -> Any:
    """The setting ``name``: description and bound from :class:`EngineConfig`, its one definition.

    Args:
        name: the engine limit.
        default: the server's default where it differs from the engine's.
        unset: the ``auto_*`` field that decides the limit when the setting is None (its help says how).
        checks: pydantic checks beyond (or instead of) the limit's bound.
    """
    description = limit_help(name) + (f"; unset: {limit_help(unset)}" if unset else "")
    bound = {"ge": limit_bound(name)} if limit_bound(name) is not None else {}
    return Field(limit_default(name) if default is _DEFAULT else default, description=description,
                 **{**bound, **checks})


class ServeSettings(BaseSettings):
    """Settings of the HTTP server and the engine behind it."""

    model_config = SettingsConfigDict(env_prefix="FEDMOSAIC_SERVE_", extra="ignore")

    model: str = Field("smollm2", description="base model: smollm2, tiny, or an HF model folder (a served run's "
                       "own, from its run.json, unless given)")
    served_model_name: str | None = Field(None, description="name of the base model in the API (default: model)")
    model_aliases: Keys = Field(default_factory=list, description="more names of the base model in the API "
                                "(`--served-model-name NAME ALIAS...`, as vLLM)")
    dtype: str | None = Field(None, description="float32, bfloat16 or autocast-bf16 (default: FEDMOSAIC_DTYPE, "
                                                "else bfloat16 on CUDA, autocast-bf16 on a CPU with native "
                                                "bf16, float32 on other CPUs)")
    device: str | None = Field(None, pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
                               description="auto, cpu, cuda or cuda:N (default: FEDMOSAIC_DEVICE, else auto)")
    run_dir: Path | None = Field(None, description="a training run directory to serve (global + clients)")
    adapters: list[str] = Field(default_factory=list, description="extra adapters as name=folder")
    adapter_root: Path | None = Field(None, description="adapter folders must lie inside it (default: run dir)")
    target_modules: str | None = Field(None, description="Linear layers to adapt besides the served adapters' own "
                                       "targets (always adapted, their union): names (q_proj,v_proj), a regex or "
                                       "all-linear; runtime-loaded adapters must fit in the union")
    max_loras: int = Field(16, ge=1, description="adapters loaded at once (LRU beyond)")
    # the engine's limits: each defined once in serving.engine.config (description, bound; default unless noted)
    max_batch_size: int | None = _engine("max_batch_size", None, unset="auto_slots")
    max_model_len: int | None = _engine("max_model_len", None, unset="auto_context", ge=2)
    max_waiting: int = _engine("max_waiting", 64)  # a server answers 429 sooner than a library caller waits
    max_prefill_tokens: int = _engine("max_prefill_tokens")
    max_decode_skips: int = _engine("max_decode_skips")
    max_lora_rank: int = _engine("max_lora_rank")
    prefix_cache_slots: int = _engine("prefix_cache_slots")
    route_state_cache: int = _engine("route_state_cache")
    request_timeout_s: float | None = _engine("request_timeout_s", 600.0, gt=0)  # no HTTP client waits forever
    shutdown_timeout_s: float = Field(10.0, ge=0, description="on shutdown, running requests get this long to finish")
    exit_on_engine_failure: bool = Field(True, description="exit with status 70 when the engine thread dies, so "
                                         "a supervisor restarts the server")
    max_tokens_limit: int = Field(1024, ge=1, description="largest max_tokens a request may ask for")
    default_max_tokens: int = Field(128, ge=1)
    max_choices: int = Field(64, ge=1, description="choices one request may ask for (prompts x n)")
    strict_fields: bool = Field(False, description="refuse (400) request fields this server does not implement "
                                "instead of ignoring them with a warning")
    generation_config: str = Field("auto", min_length=1, description="sampling defaults for fields a request leaves "
                                   "unset: auto (the model's generation_config.json), vllm (none), or a folder "
                                   "holding a generation_config.json")
    allowed_origins: Keys = Field(default_factory=list, description="CORS: browser origins allowed to call the "
                                  "API ('*' for any; none: no CORS headers)")
    max_body_bytes: int = Field(1_000_000, ge=1024, description="largest request body (413 beyond)")
    api_keys: Keys = Field(default_factory=list, description="user bearer keys (inference, /v1/models); with no "
                           "key of any kind the server is open")
    admin_keys: Keys = Field(default_factory=list, description="admin bearer keys (also adapter load/unload, run "
                             "files, protected metrics, FedDPA routing details)")
    api_key_file: Path | None = Field(None, description="user keys, one per line ('#' comments)")
    admin_key_file: Path | None = Field(None, description="admin keys, one per line ('#' comments)")
    key_bindings: Path | None = Field(None, description="JSON file binding user keys to the targets they may use "
                                      "(serving.access)")
    allow_runtime_lora: bool | None = Field(None, description="enable /v1/load_lora_adapter and /v1/unload_lora_adapter"
                                            " (null: on exactly when an admin key is configured)")
    routing_details: Literal["admin", "all", "none"] = Field(
        "admin", description="who sees FedDPA routing details (similarities, S, lambda) in responses; everyone "
        "else gets the mode and the weights")
    protect_metrics: bool = Field(False, description="/metrics needs an admin key (when admin keys are configured)")
    default_alpha: float = Field(0.5, ge=0, le=1, description="FedDPA local weight without run.json or router")
    # FedDPA's options: each defined once in routing.feddpa_options (type, default, help, checks)
    feddpa_routing: Routing = _feddpa("routing")
    feddpa_weighting: Rule | None = _feddpa("weighting")
    feddpa_samples: int = _feddpa("samples", ge=1)
    feddpa_prefill: Prefill = _feddpa("prefill")
    feddpa_mode: Mode = _feddpa("mode")
    feddpa_similarity: Similarity = _feddpa("similarity")
    feddpa_variant: Variant = _feddpa("variant")
    feddpa_embedding: Pooling = _feddpa("embedding")
    check_base: bool = Field(True, description="refuse adapters trained on another base model")
    count_syncs: bool = _engine("count_syncs")
    profile_dir: Path | None = Field(None, description="write a torch profiler trace of 16 engine steps (after 8) "
                                     "into this folder (serving.engine.host_work.StepProfiler)")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # HTTP server limits (serving.api.server): slow or idle clients must not hold sockets forever
    header_timeout_s: float = Field(10.0, gt=0, description="a connection's request headers must arrive within "
                                    "this many seconds (of connecting or of the previous response); closed beyond")
    body_timeout_s: float = Field(30.0, gt=0, description="a request body must arrive within this many seconds "
                                  "of the headers (408 beyond)")
    keep_alive_s: int = Field(5, ge=1, description="idle keep-alive connections are closed after this many seconds")
    max_connections: int = Field(512, ge=1, description="open connections and requests at most; requests beyond "
                                 "are answered 503 (uvicorn's limit_concurrency)")
    max_header_bytes: int = Field(65536, ge=1024, description="request line and headers at most (h11's limit; "
                                  "the connection is refused beyond)")

    def engine_config(self) -> EngineConfig:
        """The engine limits of these settings; an unset ``max_batch_size`` or ``max_model_len`` is sized at engine
        build (``auto_slots``, ``auto_context``), the engine's default standing in until then."""
        given = {name: getattr(self, name) for name in ENGINE_LIMITS}
        return EngineConfig(**{**given, "max_batch_size": self.max_batch_size or limit_default("max_batch_size"),
                               "max_model_len": self.max_model_len or limit_default("max_model_len")},
                            auto_slots=self.max_batch_size is None, auto_context=self.max_model_len is None)

    def feddpa_options(self) -> FedDPAOptions:
        """The ``feddpa_*`` settings as the stack's :class:`~routing.feddpa_options.FedDPAOptions`."""
        return FedDPAOptions(**{name: getattr(self, f"feddpa_{name}") for name in OPTION_NAMES})

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, value: str | None) -> str | None:
        """A target spec :func:`adapters.targets.parse_targets` reads (a regex must compile)."""
        if value is not None:
            parse_targets(value)  # an AdapterError is a ValueError: pydantic names the field
        return value

    @field_validator("feddpa_similarity", mode="before")
    @classmethod
    def _similarity(cls, value: Any) -> Any:
        """``neg-l2`` (the command line's spelling) and ``neg_l2`` alike; anything else is refused."""
        return similarity_name(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _feddpa_rule(self) -> ServeSettings:
        """Refuse the calibrated weighting with an ablation of the paper's rule here, before anything loads."""
        self.feddpa_options()
        return self

    @model_validator(mode="after")
    def _run_model(self) -> ServeSettings:
        """Serve a run on the base model it was trained on: ``run.json``'s unless ``model`` was given, and a
        given one that differs is refused here (its adapters would not load) unless ``check_base`` is off."""
        if self.run_dir is None or not (self.run_dir / "run.json").is_file():
            return self
        try:
            trained = json.loads((self.run_dir / "run.json").read_text()).get("model")
        except (OSError, ValueError, AttributeError) as exc:
            raise ValueError(f"cannot read {self.run_dir / 'run.json'}: {exc}") from exc
        if not isinstance(trained, str) or not trained:
            return self
        if "model" not in self.model_fields_set:
            self.model = trained
        elif self.check_base and not _same_model(self.model, trained, self.run_dir):
            raise ValueError(f"the run {self.run_dir} was trained on the base model {trained!r}, not {self.model!r}; "
                             f"leave out --model (FEDMOSAIC_SERVE_MODEL) to serve it on {trained!r}")
        return self

    @field_validator("api_keys", "admin_keys", "model_aliases", "allowed_origins", mode="before")
    @classmethod
    def _key_list(cls, value: Any) -> Any:
        """Accept a JSON list or a comma-separated string (the environment's two usual spellings)."""
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [k.strip() for k in text.split(",") if k.strip()]
        return value


# The engine limits a server sets: its settings named as an EngineConfig field (the others keep the engine's).
ENGINE_LIMITS: tuple[str, ...] = tuple(n for n in ServeSettings.model_fields if n in EngineConfig.__dataclass_fields__)


def _same_model(given: str, trained: str, run_dir: Path) -> bool:
    """True when ``given`` names the model ``trained`` names (the same name, or the same folder)."""
    if given == trained:
        return True
    folder = Path(given)  # run_dir / trained is trained itself when trained is absolute
    return folder.exists() and any(p.exists() and p.resolve() == folder.resolve()
                                   for p in (Path(trained), run_dir / trained))
