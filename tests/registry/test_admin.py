import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from registry.models import *
from registry.services import tools, skills
from registry.services.common import registry_object_save
from tests.registry.factories import TenantFactory

def count(client, m):
    with CaptureQueriesContext(connection) as q:
        r = client.get(f"/admin/registry/{m}/")
    assert r.status_code == 200
    return len(q)

def test_explore(client, platform_admin, publisher, make_tool_version, make_skill_version, acme):
    client.force_login(platform_admin)
    mc = registry_object_save(instance=ModelConfig(name="offline", provider="offline", model_name="x"), actor=platform_admin)
    def add(i):
        v = make_tool_version(name=f"tool_{i}")
        tools.tool_version_publish(tool_version=v, actor=publisher)
        s = make_skill_version(name=f"skill-{i}", tool_versions=[v])
        skills.skill_version_publish(skill_version=s, actor=publisher)
        t = TenantFactory()
        pol = registry_object_save(instance=Policy(tenant=t, name=f"p{i}"), actor=platform_admin)
        registry_object_save(instance=AgentConfig(tenant=t, name=f"a{i}", model_config=mc, policy=pol), actor=platform_admin)
        registry_object_save(instance=RolloutFlag(key=f"k{i}", skill=s.skill, skill_version=s, percentage=10), actor=platform_admin)
    add(0)
    models = ["tenant", "membership", "tool", "toolversion", "skill", "skillversion", "agentconfig", "policy", "rolloutflag"]
    before = {m: count(client, m) for m in models}
    add(1); add(2)
    after = {m: count(client, m) for m in models}
    print(before); print(after)
