from django.db import migrations, models

from registry.models.tenancy import password_fingerprints


def fingerprint_issued_tokens(apps, schema_editor):
    """A token issued before tokens kept their fingerprint is taken to have been exchanged
    for the password its user has now: it keeps working until that password changes."""
    ApiToken = apps.get_model("registry", "ApiToken")
    for token in ApiToken.objects.select_related("user").iterator():
        token.password_fingerprint = password_fingerprints(token.user.password)[0]
        token.save(update_fields=["password_fingerprint"])


class Migration(migrations.Migration):
    dependencies = [
        ("registry", "0014_mcp_remote_tool_definition_restrict"),
    ]

    operations = [
        migrations.AddField(
            model_name="apitoken",
            name="password_fingerprint",
            field=models.CharField(
                default="",
                editable=False,
                help_text="Of the user's password when the token was issued: changing the "
                "password ends the token, as it ends the user's sessions.",
                max_length=64,
            ),
            preserve_default=False,
        ),
        migrations.RunPython(fingerprint_issued_tokens, migrations.RunPython.noop),
    ]
