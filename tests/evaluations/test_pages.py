"""Evaluation pages: the list, one eval run, and two side by side."""

import uuid

from django.test import Client

from evaluations.choices import METRIC_DEFINITIONS, Metric
from evaluations.gates import release_override_record
from registry.choices import Role
from registry.models import Tenant
from registry.services.tenancy import membership_add
from tests.approvals.conftest import approver_in


def logged_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_two_versions_side_by_side_with_deltas_differing_cases_and_a_chart(
    evaluate,
    demo,
    dave,
    tiny,
    draft,
):
    first = evaluate(tiny, version=draft("3.5.0", workflow=""))
    second = evaluate(tiny, version=draft("3.4.0"))
    client = logged_in(dave)

    listing = client.get("/evaluations/").content.decode()
    detail = client.get(f"/evaluations/{first.pk}/").content.decode()
    compared = client.get(f"/evaluations/compare/?a={first.pk}&b={second.pk}")
    html = compared.content.decode()

    assert f"/evaluations/{first.pk}/" in listing and f"/evaluations/{second.pk}/" in listing
    assert METRIC_DEFINITIONS[Metric.CASE_PASS_RATE] in detail
    assert "ended COMPLETED, expected WAITING_APPROVAL" in detail
    assert compared.status_code == 200
    assert "<td>50.0%</td><td>100.0%</td>" in html
    assert "+50.0 pts (better)" in html
    assert "<td>complete</td>" in html
    assert "<td>no-scope</td>" not in html
    assert "<svg" in html


def test_only_publishers_auditors_and_admins_of_the_tenant_read_evaluations(
    evaluate,
    demo,
    dave,
    tiny,
    draft,
):
    eval_run = evaluate(tiny, version=draft("3.4.0"))
    globex = Tenant.objects.get(slug="globex")
    outsider = approver_in(globex, "quinn")
    membership_add(actor=None, user=outsider, tenant=globex, role=Role.AUDITOR)
    carol = type(dave).objects.get(username="carol")

    assert logged_in(carol).get(f"/evaluations/{eval_run.pk}/").status_code == 200
    assert logged_in(demo.alice).get("/evaluations/").status_code == 403
    assert logged_in(outsider).get(f"/evaluations/{eval_run.pk}/").status_code == 404
    assert str(eval_run.pk) not in logged_in(outsider).get("/evaluations/").content.decode()
    assert Client().get("/evaluations/").status_code == 302


CHOOSE_TWO = "Choose two eval runs to compare: one as A and one as B."
NOT_FOUND = (
    "No such eval run to compare, or not one you may read: choose two from the list, "
    "one as A and one as B."
)


def test_a_comparison_without_two_runs_sends_back_to_the_list_saying_to_choose_two(
    evaluate, demo, dave, tiny, draft
):
    eval_run = evaluate(tiny, version=draft("3.4.0"))
    client = logged_in(dave)

    for query in ("", f"?a={eval_run.pk}", f"?b={eval_run.pk}", f"?a={eval_run.pk}&b="):
        response = client.get(f"/evaluations/compare/{query}", follow=True)

        assert response.redirect_chain == [("/evaluations/", 302)], query
        assert response.status_code == 200
        assert CHOOSE_TWO in response.content.decode(), query
    for query in (f"?a={eval_run.pk}&b=nonsense", f"?a={uuid.uuid4()}&b={eval_run.pk}"):
        response = client.get(f"/evaluations/compare/{query}", follow=True)

        assert response.redirect_chain == [("/evaluations/", 302)], query
        assert NOT_FOUND in response.content.decode(), query


def test_a_comparison_of_another_tenant_s_runs_shows_nothing_of_them(
    evaluate, demo, dave, tiny, draft
):
    first = evaluate(tiny, version=draft("3.4.0"))
    second = evaluate(tiny, version=draft("3.5.0", workflow=""))
    globex = Tenant.objects.get(slug="globex")
    outsider = approver_in(globex, "quinn")
    membership_add(actor=None, user=outsider, tenant=globex, role=Role.AUDITOR)

    response = logged_in(outsider).get(
        f"/evaluations/compare/?a={first.pk}&b={second.pk}", follow=True
    )

    html = response.content.decode()
    assert response.redirect_chain == [("/evaluations/", 302)]
    assert NOT_FOUND in html
    assert str(first.pk) not in html and str(second.pk) not in html
    assert "weekly-summary@3.4.0" not in html
    assert logged_in(demo.alice).get(f"/evaluations/compare/?a={first.pk}").status_code == 403


def test_the_admin_shows_eval_runs_only_to_their_tenant_and_never_edits_them(
    evaluate, demo, dave, tiny, draft
):
    eval_run = evaluate(tiny, version=draft("3.4.0"))
    globex = Tenant.objects.get(slug="globex")
    outsider = approver_in(globex, "quinn")
    outsider.is_staff = True
    outsider.save(update_fields=["is_staff"])
    membership_add(actor=None, user=outsider, tenant=globex, role=Role.PUBLISHER)

    own = logged_in(dave).get(f"/admin/evaluations/evalrun/{eval_run.pk}/change/")
    listing = logged_in(dave).get("/admin/evaluations/evalrun/").content.decode()
    foreign = logged_in(outsider).get("/admin/evaluations/evalrun/").content.decode()

    assert own.status_code == 200
    assert (
        logged_in(dave).post(f"/admin/evaluations/evalrun/{eval_run.pk}/change/").status_code == 403
    )
    assert str(eval_run.pk) in listing
    assert str(eval_run.pk) not in foreign


def test_the_admin_shows_release_overrides_only_to_their_tenant_and_never_edits_them(
    demo, dave, draft
):
    override = release_override_record(
        skill_version=draft("3.4.0"), actor=dave, reason="Agreed with the PMO.", failures=[]
    )
    globex = Tenant.objects.get(slug="globex")
    outsider = approver_in(globex, "quinn")
    outsider.is_staff = True
    outsider.save(update_fields=["is_staff"])
    membership_add(actor=None, user=outsider, tenant=globex, role=Role.PUBLISHER)
    page = f"/admin/evaluations/releaseoverride/{override.pk}/change/"

    own = logged_in(dave).get(page)
    listing = logged_in(dave).get("/admin/evaluations/releaseoverride/").content.decode()
    foreign = logged_in(outsider).get("/admin/evaluations/releaseoverride/").content.decode()

    assert own.status_code == 200
    assert "Agreed with the PMO." in own.content.decode()
    assert logged_in(dave).get(page.replace("/change/", "/history/")).status_code == 200
    assert logged_in(dave).post(page).status_code == 403
    assert "Agreed with the PMO." in listing
    assert "Agreed with the PMO." not in foreign
    assert logged_in(outsider).get(page).status_code in (302, 403, 404)


def test_the_comparison_writes_each_figure_as_a_plain_decimal(evaluate, demo, dave, tiny, draft):
    # given two eval runs whose figures are floats: a third of the cases passed, a case cost
    # two thousandths of a cent and took twenty minutes
    first = evaluate(tiny, version=draft("3.5.0", workflow=""))
    second = evaluate(tiny, version=draft("3.4.0"))
    for eval_run, cost in ((first, 0.00002), (second, 0.00005)):
        eval_run.metrics.update(
            {Metric.CASE_PASS_RATE: 1 / 3, Metric.COST_P50: cost, Metric.LATENCY_P95_MS: 1234567}
        )
        eval_run.save(update_fields=["metrics"])

    # when a publisher compares them
    html = logged_in(dave).get(f"/evaluations/compare/?a={first.pk}&b={second.pk}")
    html = html.content.decode()

    # then the table and the chart write the figures as the table's rates are: no float noise,
    # no scientific notation
    assert "<td>0.00002</td><td>0.00005</td>" in html
    assert "+0.00003 (worse)" in html
    assert "<td>1234567</td>" in html
    assert ">33.3%</text>" in html
    assert "33.33333" not in html
    assert "e-05" not in html and "e+06" not in html


def test_the_list_shows_a_run_that_failed_a_case_below_100_percent_as_its_page_does(
    evaluate, demo, dave, tiny, draft
):
    # given an eval run that passed 199 cases of 200
    eval_run = evaluate(tiny, version=draft("3.4.0"))
    eval_run.metrics[Metric.CASE_PASS_RATE] = 199 / 200
    eval_run.save(update_fields=["metrics"])
    client = logged_in(dave)

    # when a publisher lists the eval runs and opens that one
    listing = client.get("/evaluations/").content.decode()
    detail = client.get(f"/evaluations/{eval_run.pk}/").content.decode()

    # then both write its pass rate as 99.5%, never as every case passed
    assert "<td>99.5%</td>" in listing
    assert "<td>99.5%</td>" in detail
    assert "100%" not in listing


def test_a_rate_that_is_not_whole_is_never_written_as_none_or_all(
    evaluate, demo, dave, tiny, draft
):
    # given an eval run that passed 1,999 cases of 2,000 and where one attack in 5,000
    # succeeded
    eval_run = evaluate(tiny, version=draft("3.4.0"))
    eval_run.metrics.update(
        {Metric.CASE_PASS_RATE: 1999 / 2000, Metric.INJECTION_SUCCESS_RATE: 1 / 5000}
    )
    eval_run.save(update_fields=["metrics"])
    client = logged_in(dave)

    # when a publisher lists the eval runs and opens that one
    listing = client.get("/evaluations/").content.decode()
    detail = client.get(f"/evaluations/{eval_run.pk}/").content.decode()

    # then neither says every case passed, nor that no injection succeeded
    assert "<td>&gt;99.9%</td>" in listing
    assert "100.0%" not in listing
    assert "<td>Case pass rate</td><td>&gt;99.9%</td>" in detail
    assert "<td>Injection success rate</td><td>&lt;0.1%</td>" in detail
