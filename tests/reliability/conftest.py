from tests.approvals.conftest import bob, demo, smtp_server  # noqa: F401 (the running example, SMTP)
