from evaluations.models.gates import EvalThreshold, ReleaseOverride
from evaluations.models.results import EvalCaseResult, EvalRun
from evaluations.models.suites import EvalCase, EvalSuite

__all__ = [
    "EvalCase",
    "EvalCaseResult",
    "EvalRun",
    "EvalSuite",
    "EvalThreshold",
    "ReleaseOverride",
]
