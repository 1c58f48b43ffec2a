"""Parameter groups: the ordered rules of ``[[optimizer.param_groups]]``, the ``optimizer.no_decay`` preset and
``optimizer.name = "Muon"``'s default rule set, resolved over the model's canonical parameter names.

Light (no torch.distributed): the pre-launch check resolves the rules over the meta model's names, and the
trainer resolves the same rules over each rank's model parts (components/optim/optimizer.py). Names are canonical
(checkpoint names): the wrappers of activation checkpointing and torch.compile are stripped, and float8 keeps
the Linear's own names, so one rule set holds under every layout and pipeline stage.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torchtitan.config.errors import ConfigError
from torchtitan.config.schema import Optimizer as OptimizerConfig

if TYPE_CHECKING:
    from torchtitan.config.manager import JobConfig
    from torchtitan.distributed.parallel_dims import ParallelDims

OPTIMIZERS = ("AdamW", "Adam", "Muon")
_ADAM_KEYS = ("betas", "eps")
_MUON_KEYS = ("momentum", "nesterov", "ns_steps", "ns_coefficients", "adjust_lr_fn", "eps")
_COMMON_KEYS = ("pattern", "optimizer", "lr", "lr_multiplier", "weight_decay")
MUON_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's defaults (Keller Jordan's)
MUON_EPS = 1e-7

# optimizer.no_decay's words, as regexes searched in each family's canonical names (tests/unit/test_param_groups.py
# checks llama3, qwen3, deepseek_v3 and gpt_oss): a norm module's weight or bias (attention_norm, ffn_norm, norm,
# q_norm, k_norm, kv_norm), any bias (Linear biases and gpt_oss's stacked expert biases b1/b2/b3), the token
# embedding. gpt_oss's attention sinks are none of the three and keep their decay.
NO_DECAY_KINDS = {
    "norm": r"(^|\.)\w*norm\.(weight|bias)$",
    "bias": r"(\.bias$|\.experts\.b\d+$)",
    "embedding": r"(^|\.)\w*embeddings?\.weight$",
}
# optimizer.name = "Muon": what stays with AdamW (besides every parameter that is not a matrix).
_NOT_HIDDEN = r"(^|\.)(\w*embeddings?|output|router)\."
_WRAPPERS = re.compile(r"(^|\.)(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)(?=\.)")


def canonical_name(name: str) -> str:
    """The checkpoint name of a parameter: the wrappers' module names left out."""
    return _WRAPPERS.sub("", name).lstrip(".")


def is_muon_shape(name: str, shape: tuple[int, ...]) -> bool:
    """A matrix, or a stack of expert matrices (orthogonalised per expert)."""
    return len(shape) == 2 or (len(shape) == 3 and re.search(r"\.experts\.w\d+$", name) is not None)


@dataclass(frozen=True)
class Rule:
    index: int
    """Position in optimizer.param_groups (-1: a built-in rule)."""
    pattern: str
    optimizer: str | None
    """None: the section's optimizer (under name = "Muon": Muon for hidden matrices, AdamW for the rest)."""
    settings: dict[str, Any] = field(default_factory=dict)

    def label(self) -> str:
        return (
            f"optimizer.param_groups[{self.index}] (pattern {self.pattern!r})"
            if self.index >= 0
            else "(every parameter)"
        )


@dataclass
class Group:
    """One optimizer param group: the parameters one rule gave one optimizer with one weight decay."""

    rule: Rule
    optimizer: str
    settings: dict[str, Any]
    names: list[str] = field(default_factory=list)
    numel: int = 0


def parse_rules(config: OptimizerConfig) -> list[Rule]:
    """``optimizer.param_groups`` checked key by key, or the one built-in catch-all rule.

    Raises:
        ConfigError: an unknown optimizer or keyword, a pattern that is not a regex, a bad no_decay word.
    """
    for word in config.no_decay:
        if word not in NO_DECAY_KINDS:
            raise ConfigError(
                f"optimizer.no_decay: {word!r} is not a kind; allowed are {list(NO_DECAY_KINDS)} (comma-separated on "
                "the command line)"
            )
    if not config.param_groups:
        return [Rule(-1, ".*", None)]
    return [_parse_rule(i, raw, config) for i, raw in enumerate(config.param_groups)]


def _parse_rule(i: int, raw: dict[str, Any], config: OptimizerConfig) -> Rule:
    where = f"optimizer.param_groups[{i}]"
    if "pattern" not in raw or not isinstance(raw["pattern"], str):
        raise ConfigError(f"{where} has no pattern: give each rule pattern = a regex over parameter names ('.*': all)")
    try:
        re.compile(raw["pattern"])
    except re.error as e:
        raise ConfigError(f"{where}: pattern {raw['pattern']!r} is not a regex ({e})") from None
    opt = raw.get("optimizer")
    if opt is not None and opt not in OPTIMIZERS:
        raise ConfigError(f"{where}: optimizer = {opt!r} is unknown; allowed are {list(OPTIMIZERS)}")
    kind = opt or config.name
    allowed = _COMMON_KEYS + (_ADAM_KEYS + _MUON_KEYS if opt is None and kind == "Muon" else _keys_of(kind))
    for key in raw:
        if key not in allowed:
            raise ConfigError(
                f"{where}: unknown keyword {key!r} for optimizer {kind}; allowed are {sorted(set(allowed))}"
            )
    settings = {k: v for k, v in raw.items() if k not in ("pattern", "optimizer")}
    if "betas" in settings:
        settings["betas"] = tuple(settings["betas"])
    if "ns_coefficients" in settings:
        settings["ns_coefficients"] = tuple(settings["ns_coefficients"])
    return Rule(i, raw["pattern"], opt, settings)


def _keys_of(kind: str) -> tuple[str, ...]:
    return _MUON_KEYS if kind == "Muon" else _ADAM_KEYS


def section_settings(kind: str, config: OptimizerConfig) -> dict[str, Any]:
    """The section's hyper-parameters for one optimizer kind (what a rule's unset keys take)."""
    if kind == "Muon":
        return {
            "lr": config.muon_lr if config.muon_lr is not None else config.lr,
            "weight_decay": config.weight_decay,
            "momentum": config.muon_momentum,
            "nesterov": config.muon_nesterov,
            "ns_steps": config.muon_ns_steps,
            "ns_coefficients": MUON_NS_COEFFICIENTS,
            "eps": MUON_EPS,
            "adjust_lr_fn": config.muon_adjust_lr_fn,
        }
    return {
        "lr": config.lr,
        "betas": (config.beta1, config.beta2),
        "eps": config.eps,
        "weight_decay": config.weight_decay,
    }


def assign_groups(named_shapes: Iterable[tuple[str, tuple[int, ...]]], config: OptimizerConfig) -> list[Group]:
    """Each parameter (canonical name, shape) to its group: the first matching rule, its optimizer, and weight
    decay 0 where optimizer.no_decay names it. Groups are ordered by rule, then optimizer, then decay.

    Raises:
        ConfigError: a parameter no rule matches; Muon asked for a parameter that is not a matrix.
    """
    rules = parse_rules(config)
    compiled = [re.compile(r.pattern) for r in rules]
    no_decay = [re.compile(NO_DECAY_KINDS[w]) for w in config.no_decay]
    groups: dict[tuple[int, str, bool], Group] = {}
    unmatched: list[str] = []
    for name, shape in named_shapes:
        name = canonical_name(name)
        hit = next((i for i, c in enumerate(compiled) if c.search(name)), None)
        if hit is None:
            unmatched.append(name)
            continue
        rule = rules[hit]
        kind = rule.optimizer or _default_kind(name, shape, config.name)
        if kind == "Muon" and not is_muon_shape(name, shape):
            raise ConfigError(
                f"{rule.label()} gives Muon to {name} of shape {list(shape)}: Muon updates matrices only (2-D, or "
                "stacked expert weights); add a rule before it that gives this parameter AdamW"
            )
        nd = any(c.search(name) for c in no_decay)
        group = groups.get((hit, kind, nd))
        if group is None:
            settings = section_settings(kind, config)
            settings.update({k: v for k, v in rule.settings.items() if k in settings or k == "lr_multiplier"})
            settings["lr"] = settings["lr"] * settings.pop("lr_multiplier", 1.0)
            if nd:
                settings["weight_decay"] = 0.0
            group = groups[(hit, kind, nd)] = Group(rule, kind, settings)
        group.names.append(name)
        group.numel += _numel(shape)
    if unmatched:
        raise ConfigError(
            f"optimizer.param_groups: {len(unmatched)} parameters match no rule, e.g. {unmatched[:3]}; end the "
            "rules with a catch-all (pattern = '.*')"
        )
    return [groups[k] for k in sorted(groups, key=lambda k: (k[0], OPTIMIZERS.index(k[1]), k[2]))]


def _default_kind(name: str, shape: tuple[int, ...], section: str) -> str:
    if section != "Muon":
        return section
    not_hidden = re.search(_NOT_HIDDEN, name) or re.search(NO_DECAY_KINDS["bias"], name)  # gpt_oss's 2-D b1
    hidden = is_muon_shape(name, shape) and not not_hidden
    return "Muon" if hidden else "AdamW"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def check_rules_match(named_shapes: list[tuple[str, tuple[int, ...]]], config: OptimizerConfig) -> list[Group]:
    """``assign_groups`` over the whole model, and each rule of optimizer.param_groups matches some parameter."""
    groups = assign_groups(named_shapes, config)
    used = {g.rule.index for g in groups}
    for rule in parse_rules(config):
        if rule.index >= 0 and rule.index not in used:
            names = [canonical_name(n) for n, _ in named_shapes[:3]]
            raise ConfigError(
                f"{rule.label()} matches no parameter (or only ones an earlier rule took); the model's names look "
                f"like {names}; fix the pattern or remove the rule"
            )
    return groups


def format_group_table(groups: list[Group]) -> str:
    """The start log's table: each group, its rule, parameter count and settings."""
    rows = [("group", "rule", "optimizer", "params", "tensors", "settings")]
    for i, g in enumerate(groups):
        settings = ", ".join(f"{k}={_short(v)}" for k, v in g.settings.items())
        rows.append((str(i), g.rule.label(), g.optimizer, f"{g.numel:,}", str(len(g.names)), settings))
    widths = [max(len(r[c]) for r in rows) for c in range(5)]
    return "\n".join("  ".join(r[c].ljust(widths[c]) for c in range(5)) + "  " + r[5] for r in rows)


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, tuple):
        return "(" + ",".join(_short(x) for x in v) + ")"
    return str(v)


def check_param_groups(config: JobConfig, dims: ParallelDims) -> list[str]:
    """Pre-launch: the rules over the whole model's canonical names (on the meta device): each rule matches a
    parameter, each parameter matches a rule, Muon only on matrices; unknown optimizers and keywords."""
    opt = config.optimizer
    parse_rules(opt)  # the keys alone, whatever the model
    if not opt.param_groups and not opt.no_decay and opt.name != "Muon":
        return []
    import dataclasses

    import torch

    from torchtitan.spec import flavor_args, get_model_spec

    args = dataclasses.replace(flavor_args(config.model), norm_type=config.model.norm_type)
    with torch.device("meta"):
        model = get_model_spec(config.model.name).model_cls(args)
    check_rules_match([(n, tuple(p.shape)) for n, p in model.named_parameters()], opt)
    return []


def optimizer_state_by_group(named_shapes: list[tuple[str, tuple[int, ...]]], config: OptimizerConfig) -> list[dict]:
    """Per group of the whole model (before sharding): its optimizer, parameters and state (the estimator's report
    and the planner's lower bound). Adam/AdamW keep 2 moments (``state_dtype`` bytes each), Muon 1 momentum (fp32);
    Muon's transient full-matrix buffers of the distributed step are not state: the estimator's run measures them."""
    moment_bytes = 2 if config.state_dtype == "bfloat16" else 4
    rows = []
    for g in assign_groups(named_shapes, config):
        states, nbytes = (1, 4) if g.optimizer == "Muon" else (2, moment_bytes)
        rows.append(
            {
                "rule": g.rule.label(),
                "optimizer": g.optimizer,
                "weight_decay": g.settings["weight_decay"],
                "params": g.numel,
                "states_per_param": states,
                "state_bytes": g.numel * states * nbytes,
            }
        )
    return rows
