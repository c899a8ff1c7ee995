"""The running example's business data as plain Python: acme's projects with this week's
tasks, milestones and risks, their directory records and who may see which project. The
demo seeds it into the database; the example MCP server serves it without Django."""

R_AND_D_LEAD = "研发负责人"

# key, name, viewers, updates (kind, title, status, detail, day of the week), leads
PROJECTS = {
    "acme": [
        (
            "apollo",
            "Project Apollo",
            ["alice", "bob", "carol"],
            [
                (
                    "task",
                    "API gateway migration",
                    "done",
                    "All services moved to the new gateway.",
                    0,
                ),
                ("task", "Load test plan", "in_progress", "Scenarios agreed; runs next week.", 1),
                ("milestone", "Beta release", "planned", "Feature freeze on Friday.", 4),
                ("risk", "Vendor SDK delay", "open", "The payments SDK slips by a week.", 2),
            ],
            [("dir-1001", "Li Wei", "li.wei@acme.example", 3)],
        ),
        (
            "hermes",
            "Project Hermes",
            ["alice"],
            [("task", "Search relevance tuning", "done", "", 1)],
            [
                ("dir-2001", "Zhang Min", "zhang.min@acme.example", 1),
                ("dir-2002", "Chen Jie", "chen.jie@acme.example", 2),
            ],
        ),
        (
            "zephyr",
            "Project Zephyr",
            ["alice"],
            [("task", "Firmware build", "in_progress", "", 0)],
            [("dir-3001", "Wang Fang", "", 1)],
        ),
        (
            "atlas",
            "Project Atlas",
            ["bob"],
            [("risk", "Budget review", "open", "Confidential.", 0)],
            [("dir-4001", "Zhao Lei", "zhao.lei@acme.example", 1)],
        ),
    ],
    "globex": [
        (
            "portal",
            "Globex Portal",
            ["erin"],
            [("task", "Login redesign", "done", "", 0)],
            [("dir-9001", "Hank Scorpio", "hank@globex.example", 1)],
        ),
    ],
}
