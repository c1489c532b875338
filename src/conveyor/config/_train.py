"""What ``conveyor train`` does: :class:`TrainConfig`, its sections and the rules between them, checked when it
is made (one line for every bad value, before any worker starts); the map from the command line's options to the
sections; and the run's ``config.toml``, the whole configuration on file, which ``--config`` reads back."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import tomli_w

from conveyor.config._flags import flag_name
from conveyor.config._sections import (
    ElasticConfig,
    EmulationConfig,
    EnergyConfig,
    LayoutConfig,
    ModelConfig,
    ModelStoreConfig,
    OptimizerConfig,
    RunConfig,
    StragglersConfig,
    WanConfig,
)
from conveyor.errors import InputError
from conveyor.plan import Topology

__all__ = ["OPTION_FIELDS", "SECTIONS", "TrainConfig", "read_config_file"]


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """What ``conveyor train`` does, in sections; each component takes its own. ``None`` for ``stragglers`` and
    ``elastic``: a run without them. :meth:`from_options` makes one from ``conveyor train``'s options by name.

    Example:
        >>> cfg = TrainConfig.from_options(model="mlp", epochs=3, stages=2)
        >>> cfg == TrainConfig(model=ModelConfig(name="mlp"), run=RunConfig(epochs=3), layout=LayoutConfig(stages=2))
        True
        >>> cfg.options()["epochs"], cfg.stragglers is None
        (3, True)
        >>> TrainConfig.from_toml(cfg.to_toml()) == cfg
        True
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    emulation: EmulationConfig = field(default_factory=EmulationConfig)
    energy: EnergyConfig = field(default_factory=EnergyConfig)
    stragglers: StragglersConfig | None = None
    elastic: ElasticConfig | None = None
    store: ModelStoreConfig = field(default_factory=ModelStoreConfig)
    wan: WanConfig = field(default_factory=WanConfig)

    def __post_init__(self) -> None:
        if self.stragglers is not None and self.stragglers.mode == "off":
            raise InputError("a run without straggler handling has stragglers=None, not a section whose mode is off")
        check_sections(self)

    @classmethod
    def from_options(cls, **options: Any) -> TrainConfig:
        """The config of ``conveyor train``'s options (their names with ``_`` for ``-``; ``stragglers="off"`` and
        no ``reliable`` nor ``join``: those sections are ``None``).

        Raises:
            InputError: a name that is no option, or a bad value (one line).
        """
        unknown = sorted(set(options) - set(OPTION_FIELDS))
        if unknown:
            raise InputError(f"conveyor train has no option {', '.join(unknown)}")
        values: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
        for option, value in options.items():
            section, name = OPTION_FIELDS[option]
            values[section][name] = value
        stragglers, elastic = values.pop("stragglers"), values.pop("elastic")
        return cls(
            **{section: SECTIONS[section](**given) for section, given in values.items()},
            stragglers=None if stragglers.get("mode", "off") == "off" else StragglersConfig(**stragglers),
            elastic=ElasticConfig(**elastic) if elastic.get("reliable") is not None or elastic.get("join") else None,
        )

    def replaced(self, **options: Any) -> TrainConfig:
        """This config with some options changed, by their ``conveyor train`` names."""
        return TrainConfig.from_options(**{**self.options(), **options})

    def options(self) -> dict[str, Any]:
        """Every ``conveyor train`` option's value: the inverse of :meth:`from_options` (JSON-ready)."""
        out: dict[str, Any] = {}
        for option, (section, name) in OPTION_FIELDS.items():
            part = getattr(self, section)
            out[option] = getattr(part, name) if part is not None else _DEFAULTS[option]
        return out

    def to_toml(self) -> str:
        """The whole configuration as TOML, one table per section, by field (what ``None`` means is left out)."""
        tables = {
            section: {f.name: getattr(part, f.name) for f in fields(part) if getattr(part, f.name) is not None}
            for section in SECTIONS
            if (part := getattr(self, section)) is not None
        }
        return tomli_w.dumps(tables)

    @classmethod
    def from_toml(cls, text: str, source: str = "the config") -> TrainConfig:
        """The config a TOML text describes (:meth:`to_toml`'s form; a section or field left out: its default)."""
        return cls.from_options(**toml_options(text, source))


def read_config_file(path: str) -> dict[str, Any]:
    """The options a ``config.toml`` sets, by their ``conveyor train`` names (for ``--config``; options given on
    the command line then override them).

    Raises:
        InputError: the file is missing or not TOML, or names a section or field that does not exist (one line).
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InputError(f"--config {path}: cannot read it ({exc.strerror})") from None
    return toml_options(text, path)


def toml_options(text: str, source: str) -> dict[str, Any]:
    """The options of a TOML text in :meth:`TrainConfig.to_toml`'s form, by option name."""
    try:
        tables = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{source} is not TOML: {exc}") from None
    out: dict[str, Any] = {}
    for section, values in tables.items():
        if section not in SECTIONS or not isinstance(values, dict):
            raise InputError(f"{source}: no section [{section}]; the sections are {', '.join(SECTIONS)}")
        for name, value in values.items():
            option = _OPTIONS.get((section, name))
            if option is None:
                known = ", ".join(f.name for f in fields(SECTIONS[section]))
                raise InputError(f"{source}: [{section}] has no field {name!r}; its fields are {known}")
            out[option] = value
    return out


SECTIONS: dict[str, type[Any]] = {
    "model": ModelConfig,
    "layout": LayoutConfig,
    "optimizer": OptimizerConfig,
    "run": RunConfig,
    "emulation": EmulationConfig,
    "energy": EnergyConfig,
    "stragglers": StragglersConfig,
    "elastic": ElasticConfig,
    "store": ModelStoreConfig,
    "wan": WanConfig,
}
"""Each section's name in :class:`TrainConfig` (and in ``config.toml``) -> its class."""
_OPTIONS: dict[tuple[str, str], str] = {
    (section, f.name): flag_name(f) or f.name for section, kind in SECTIONS.items() for f in fields(kind)
}
OPTION_FIELDS: dict[str, tuple[str, str]] = {option: key for key, option in _OPTIONS.items()}
"""``conveyor train``'s option (``_`` for ``-``; a field without a flag of its own by its name) -> its section
and field."""
_DEFAULTS: dict[str, Any] = {
    option: next(f.default for f in fields(SECTIONS[section]) if f.name == name)
    for option, (section, name) in OPTION_FIELDS.items()
}  # every option's default, which an absent (None) section's options read as


def check_sections(cfg: TrainConfig) -> None:
    """The rules between sections (each section checks its own fields); one line each."""
    elastic, run = cfg.elastic, cfg.run
    layout = cfg.layout
    if elastic is not None:
        if elastic.reliable is not None and (cfg.stragglers or layout.stages or layout.replicas or layout.plan):
            raise InputError(
                "--reliable plans its own layouts (--elastic-layout): drop --stragglers, --stages, --replicas, --plan"
            )
        if run.checkpoint_every is not None:
            raise InputError("--checkpoint-every saves a run of fixed workers; elastic jobs keep their own backups")
        if run.lease and elastic.join:
            raise InputError("--lease bounds the job its worker 0 starts: drop --join (the job's own lease holds)")
        if cfg.energy.tune_batch_size or cfg.energy.power_limit:
            raise InputError("--batch-size auto and --power-limit apply to fixed workers: drop --reliable and --join")
        if cfg.store.warm_start or cfg.store.register:
            raise InputError("--warm-start and --register apply to fixed workers: drop --reliable and --join")
    if cfg.model.materialize == "stage" and (
        elastic or cfg.stragglers or cfg.store.warm_start or cfg.energy.tune_batch_size
    ):
        raise InputError(
            "--materialize stage builds each worker's stage alone, for a fixed pipeline: drop --reliable, --join, "
            "--stragglers, --warm-start and --batch-size auto"
        )
    if cfg.wan.mode != "off":
        check_wan(cfg)
    if cfg.store.warm_start and run.resume:
        raise InputError("--warm-start starts a new model from a parent's weights; --resume continues one: pick one")
    if cfg.energy.tune_batch_size and (cfg.energy.job is None or run.target_accuracy is None):
        raise InputError(
            "--batch-size auto learns across recurrences of a job to a target: give --job NAME and --target-accuracy"
        )
    if cfg.energy.tune_batch_size and (run.lease or run.resume):
        raise InputError("a recurrence of --batch-size auto runs whole, from scratch: drop --lease and --resume")


def check_wan(cfg: TrainConfig) -> None:
    """``--wan``'s rules: a topology of two data centres or more, sites that step together, fixed workers."""
    mode, network = cfg.wan.mode, cfg.emulation.network
    if network is None:
        raise InputError(
            f"--wan {mode} trains across data centres: give --network with the WAN as its outer level, e.g. "
            "--network 2:1.25e9,3:6.25e6 (3 data centres of 2 workers)"
        )
    levels = Topology.parse(network).levels
    if len(levels) < 2 or levels[-1].count < 2:
        raise InputError(
            f"--wan {mode} needs two data centres or more, the outer level of --network: {network} is one data centre "
            f"(add a level, e.g. {network},2:6.25e6)"
        )
    if cfg.layout.schedule not in ("flush", "gpipe"):
        raise InputError(f"--wan {mode}: the data centres step together: give --schedule flush or gpipe")
    if cfg.elastic is not None or cfg.stragglers is not None:
        raise InputError(f"--wan {mode} runs fixed workers: drop --reliable, --join and --stragglers")
    if mode == "gaia" and cfg.wan.estimate == "auto" and cfg.model.materialize == "stage":
        raise InputError(
            "--wan-estimate auto tries the whole model before training, and --materialize stage never builds it: "
            "give --wan-estimate on or off"
        )
