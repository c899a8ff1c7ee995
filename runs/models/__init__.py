from runs.models.attachments import Attachment
from runs.models.events import RunEvent
from runs.models.memory import MemoryItem
from runs.models.runs import CancelRequest, IngressRecord, Run
from runs.models.schedules import ScheduledTask, TaskOccurrence
from runs.models.sessions import Session
from runs.models.spans import Span
from runs.models.tools import Source, ToolCall

__all__ = [
    "Attachment",
    "CancelRequest",
    "IngressRecord",
    "MemoryItem",
    "Run",
    "RunEvent",
    "ScheduledTask",
    "Session",
    "Source",
    "Span",
    "TaskOccurrence",
    "ToolCall",
]
