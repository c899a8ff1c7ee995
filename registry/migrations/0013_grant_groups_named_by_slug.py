from django.db import migrations


def grant_groups_named_by_slug(apps, schema_editor):
    """A tenant renamed before its grant group was renamed with it still has its group under
    an old slug's name: the group takes the name tenant:<slug>, the one platform admins grant
    to. The group is the tenant's by its foreign key, whatever its name.

    A name held by a group that keeps its own (one left by a deleted tenant or made by hand,
    or another tenant's group that cannot be renamed) is not taken from it: the tenant's group
    keeps its name, and the tenant is named in the output. Once that group is deleted, saving
    the tenant in the admin renames its group."""
    Group = apps.get_model("auth", "Group")
    Tenant = apps.get_model("registry", "Tenant")
    current = dict(Group.objects.values_list("pk", "name"))
    wanted = {
        group_pk: f"tenant:{slug}"
        for group_pk, slug in Tenant.objects.values_list("grant_group", "slug")
        if current[group_pk] != f"tenant:{slug}"
    }
    kept = {name for group_pk, name in current.items() if group_pk not in wanted}
    blocked = {}
    while taken := {pk: name for pk, name in wanted.items() if name in kept}:
        for group_pk in taken:
            blocked[group_pk] = wanted.pop(group_pk)
            kept.add(current[group_pk])
    # Each through a name no group holds, so that two groups may trade their names.
    for group_pk in wanted:
        Group.objects.filter(pk=group_pk).update(name=f"tenant-renaming:{group_pk}")
    for group_pk, name in wanted.items():
        Group.objects.filter(pk=group_pk).update(name=name)
    for name in sorted(blocked.values()):
        print(f"\n  A tenant's grant group is not renamed to {name}: another group holds it.")


class Migration(migrations.Migration):
    dependencies = [
        ("registry", "0012_rollout_flag_key_per_tenant"),
    ]

    operations = [
        migrations.RunPython(grant_groups_named_by_slug, migrations.RunPython.noop),
    ]
