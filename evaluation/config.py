"""The evaluation config: methods by name, stages (model x tasks x lengths x regimes x methods), comparisons.

A YAML file (see configs/smoke.yaml). Stages run in order and examples inside a stage are
interleaved across tasks and lengths, so a run stopped early leaves every cell of a stage with
about the same number of examples. Unknown keys are errors: a typo must not silently change a run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .methods import KINDS
from .tasks import TASKS

REGIMES = ("query_agnostic", "query_aware")
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Stage:
    model: str
    tasks: list[str]
    lengths: list[int]
    n: int
    methods: list[str]
    regimes: list[str] = field(default_factory=lambda: list(REGIMES))
    bases: str = "shipped"  # default bases of this stage's varrate methods
    chat: bool | None = None  # None: the model's default (chat template for SmolLM2, plain for Gemma-3)
    task_options: dict = field(default_factory=dict)  # task -> options for its builder


@dataclass
class EvalConfig:
    name: str
    methods: dict[str, dict]
    stages: list[Stage]
    comparisons: list[list[str]] = field(default_factory=list)
    output: str = ""  # relative to the repository; default evaluation/runs/<name> (git-ignored)
    threads: int = 1  # 1: no OpenMP thread spins while the shared CPU is busy (CPU-time cost instrument)
    bootstrap_samples: int = 20_000
    wait_for_bases_s: int = 0  # poll this long for shipped bases that are still being built
    report_every: int = 10  # rewrite tables and plots every this many examples
    answer_nll: bool = False  # also score the gold answer's NLL (teacher-forced) for generated-answer tasks

    @property
    def output_dir(self) -> Path:
        return REPO / (self.output or f"evaluation/runs/{self.name}")  # not tracked: see docs/results/


def load_config(path: str | Path) -> EvalConfig:
    data = yaml.safe_load(Path(path).read_text())
    _check_keys("config", data, EvalConfig)
    stages = []
    for i, raw in enumerate(data.pop("stages")):
        _check_keys(f"stages[{i}]", raw, Stage)
        stages.append(Stage(**raw))
    config = EvalConfig(stages=stages, **data)
    validate(config)
    return config


def validate(config: EvalConfig) -> None:
    for name, spec in config.methods.items():
        if spec.get("kind") not in KINDS:
            raise ValueError(f"method {name!r}: kind must be one of {list(KINDS)}, got {spec.get('kind')!r}")
    for i, stage in enumerate(config.stages):
        for method in stage.methods:
            if method not in config.methods:
                raise ValueError(f"stages[{i}] uses method {method!r}, which `methods` does not define")
        for task in stage.tasks:
            if task not in TASKS:
                raise ValueError(f"stages[{i}]: task must be one of {sorted(TASKS)}, got {task!r}")
        for regime in stage.regimes:
            if regime not in REGIMES:
                raise ValueError(f"stages[{i}]: regime must be one of {list(REGIMES)}, got {regime!r}")
    for pair in config.comparisons:
        if len(pair) != 2 or any(m not in config.methods for m in pair):
            raise ValueError(f"a comparison is a pair of defined method names, got {pair!r}")


def parse_stages(text: str, count: int) -> list[int]:
    """`--stages` ("10", "11-", "3,5-7": 0-based positions in the config's `stages` list) -> sorted indices."""
    picked = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            lo = int(first)
            hi = (int(last) if last else count - 1) if dash else lo
        except ValueError:
            raise ValueError(f"--stages takes 0-based stage indices and ranges such as '10', '11-' or '3,5-7', "
                             f"got {text!r}") from None
        if not (0 <= lo < count and 0 <= hi < count):
            raise ValueError(f"--stages {text!r}: the config has stages 0-{count - 1}; {part.strip()!r} is outside")
        if lo > hi:
            raise ValueError(f"--stages {text!r}: {part.strip()!r} is an empty range; write the lower index first")
        picked.update(range(lo, hi + 1))
    return sorted(picked)


def _check_keys(where: str, data: dict, cls) -> None:
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; known keys are {sorted(known)}")
