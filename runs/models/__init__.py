from runs.models.events import RunEvent
from runs.models.runs import IngressRecord, Run
from runs.models.sessions import Session

__all__ = ["IngressRecord", "Run", "RunEvent", "Session"]
