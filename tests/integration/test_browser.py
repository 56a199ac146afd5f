"""The console's pages in a real browser: headless Chromium from the distribution's packages, driven by Selenium,
against the real endpoint (uvicorn on a thread) and a real PostgreSQL database.

Every step is checked in the database as well as on the page, and every page is saved as a screenshot under
``test-artifacts/console/`` (look at them). Waits poll a condition with a deadline.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from pydantic import SecretStr
from sqlalchemy.engine import make_url

from worker.admin.console import Console
from worker.admin.routes import console_routes
from worker.config import AdminSettings, DatabaseSettings, Mode
from worker.db.store import Store
from worker.service.endpoint import Endpoint, Heartbeat
from worker.service.metrics import Metrics

pytestmark = pytest.mark.browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "console"
WRITE = "browser-write-token-0001"
READ = "browser-read-token-00001"
DEADLINE = 15.0

SKIP_ENV = "CORRELATION_TEST_SKIP_BROWSER"  # set to 1 to run the suite without a browser, on purpose

if CHROMIUM is None or CHROMEDRIVER is None:
    _MISSING = (
        "the browser tests need Debian's chromium and chromium-driver packages (scripts/test installs them "
        "with apt-get)"
    )
    if os.environ.get(SKIP_ENV):
        pytest.skip(f"{_MISSING}; skipped because {SKIP_ENV} is set", allow_module_level=True)
    pytest.fail(f"{_MISSING}, and they are missing; set {SKIP_ENV}=1 to skip them on purpose", pytrace=False)

from selenium import webdriver  # noqa: E402  (only once the browser is known to be there)
from selenium.common.exceptions import (  # noqa: E402
    NoSuchElementException,
    StaleElementReferenceException,
    WebDriverException,
)
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.remote.webelement import WebElement  # noqa: E402
from selenium.webdriver.support.expected_conditions import staleness_of  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402


class Database:
    """Plain SQL on the test's database, as producers and operators use it."""

    def __init__(self, url: str) -> None:
        self.dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)

    def rows(self, sql: str, params: Any = ()) -> list[dict[str, Any]]:
        with psycopg.connect(self.dsn, autocommit=True, row_factory=dict_row) as connection:
            cursor = connection.execute(sql, params)
            return cursor.fetchall() if cursor.description else []

    def insert(self, name: str, hint: str, state: str = "ready", error: str | None = None) -> int:
        row = self.rows(
            "INSERT INTO correlation_message (message_name, correlation_hint, state, last_error, attempt) "
            "VALUES (%s, %s, %s, %s, %s) RETURNING id",
            (name, hint, state, error, 3 if state == "dead" else 0),
        )
        return int(row[0]["id"])


@pytest.fixture
def console_url(pg_url: str) -> Iterator[str]:
    """The console served by a real endpoint on a free port."""
    store = Store.from_settings(DatabaseSettings(url=pg_url))
    console = Console(store, Mode.FAIL_FIRST, AdminSettings(token=SecretStr(WRITE), read_token=SecretStr(READ)))
    endpoint = Endpoint("127.0.0.1", 0, Metrics(), Heartbeat(), 60.0, lambda: None, console=console_routes(console))
    try:
        yield f"http://127.0.0.1:{endpoint.port}"
    finally:
        endpoint.close()
        store.close()


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    """Headless Chromium with a fresh profile."""
    profile = tempfile.mkdtemp(prefix="cw-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1280,900",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait(driver: WebDriver, condition: Callable[[WebDriver], Any], what: str) -> Any:
    """Poll ``condition`` until it is truthy, failing with ``what`` after the deadline."""
    # The overview's live refresh replaces its elements, and a form posted or a redirect replaces the page: one
    # read between the find and the use may meet an element of the old page. Selenium calls that stale; Chromium
    # sometimes names it a node that "does not belong to the document". Either way the condition is read again.

    def current(d: WebDriver) -> Any:
        try:
            return condition(d)
        except WebDriverException as error:
            if "does not belong to the document" in str(error):
                raise StaleElementReferenceException(str(error)) from error
            raise

    waiting = WebDriverWait(
        driver, DEADLINE, poll_frequency=0.05,
        ignored_exceptions=(NoSuchElementException, StaleElementReferenceException),
    )
    return waiting.until(current, message=f"waited for {what}")


def text_of(driver: WebDriver, element_id: str) -> str:
    found = driver.find_elements(By.ID, element_id)
    return found[0].text if found else ""


def shoot(driver: WebDriver, name: str) -> None:
    """Save the page as a test artefact."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def click(driver: WebDriver, element_id: str) -> None:
    driver.find_element(By.ID, element_id).click()


def log_in(driver: WebDriver, base: str, token: str) -> None:
    driver.get(base + "/ui/")
    wait(driver, lambda d: d.find_elements(By.ID, "token"), "the login form")
    driver.find_element(By.ID, "token").send_keys(token)
    click(driver, "login")
    wait(driver, lambda d: d.find_elements(By.ID, "count-ready"), "the overview after logging in")


def row_ids(table: WebElement) -> list[int]:
    return [int(str(row.get_attribute("data-id"))) for row in table.find_elements(By.CSS_SELECTOR, "tbody tr")]


def test_an_operator_logs_in_watches_the_overview_finds_a_stuck_hint_requeues_and_pauses(
    browser: WebDriver, console_url: str, pg_url: str
) -> None:
    db = Database(pg_url)
    driver = browser

    # Log in: a wrong token is refused, the right one opens the overview.
    driver.get(console_url + "/ui/")
    wait(driver, lambda d: d.find_elements(By.ID, "token"), "the login form")
    shoot(driver, "01-login")
    driver.find_element(By.ID, "token").send_keys("not-the-token-at-all")
    click(driver, "login")
    wait(driver, lambda d: "wrong token" in text_of(d, "error"), "the wrong token to be refused")
    driver.find_element(By.ID, "token").send_keys(WRITE)
    click(driver, "login")
    wait(driver, lambda d: text_of(d, "count-ready") == "0", "the overview of an empty table")
    session = driver.get_cookie("cw_session")
    assert session is not None and session["httpOnly"] and session["sameSite"] == "Strict"

    # The overview refreshes itself (no reload: a marker set on the page survives) after inserts with SQL.
    driver.execute_script("window.__notReloaded = true;")
    for n in range(3):
        db.insert("order.paid", f"order-{n}")
    wait(driver, lambda d: text_of(d, "count-ready") == "3", "the overview to show 3 ready messages")
    assert driver.execute_script("return window.__notReloaded === true;")
    shoot(driver, "02-overview")

    # A stuck hint: its dead message holds back the later one; found from the messages page.
    head = db.insert("order.shipped", "order-42")
    dead = db.insert("order.shipped", "order-42", state="dead", error="RuntimeError: the engine said no")
    behind = db.insert("order.shipped", "order-42")
    click_nav(driver, "Messages")
    Select(driver.find_element(By.NAME, "state")).select_by_value("dead")
    driver.find_element(By.CSS_SELECTOR, "form.filters button").click()
    wait(driver, lambda d: row_ids(d.find_element(By.ID, "messages")) == [dead], "the dead message listed")
    shoot(driver, "03-messages")
    driver.find_element(By.LINK_TEXT, "order-42").click()
    wait(driver, lambda d: d.find_elements(By.ID, "hint-messages"), "the hint's page")
    assert row_ids(driver.find_element(By.ID, "hint-messages")) == [head, dead, behind]
    blocker = driver.find_element(By.CSS_SELECTOR, "#hint-messages tr.blocker")
    assert blocker.get_attribute("data-id") == str(dead)
    assert text_of(driver, "blocker-reason") == "dead: RuntimeError: the engine said no"
    assert "held back behind message" in driver.find_element(By.CSS_SELECTOR, f"tr[data-id='{behind}']").text
    shoot(driver, "04-hint")
    driver.find_element(By.LINK_TEXT, str(dead)).click()
    wait(driver, lambda d: "the engine said no" in text_of(d, "last-error"), "the message's page")
    shoot(driver, "05-message")

    # Dead letters requeued by filter: preview count, confirm, the database says ready with attempts reset.
    invoices = [db.insert("invoice.sent", f"inv-{n}", state="dead", error="HTTP 500") for n in range(5)]
    click_nav(driver, "Dead letters")
    driver.find_element(By.ID, "dead-name").send_keys("invoice.sent")
    click(driver, "dead-filter")
    wait(driver, lambda d: row_ids(d.find_element(By.ID, "messages")) == invoices, "the invoices' dead letters")
    shoot(driver, "06-dead-letters")
    click(driver, "bulk-requeue")
    wait(driver, lambda d: text_of(d, "preview-count") == "5", "the preview count")
    shoot(driver, "07-confirm")
    click(driver, "confirm")
    wait(driver, lambda d: text_of(d, "flash") == "requeued 5 messages", "the requeue to be reported")
    requeued = db.rows("SELECT state, attempt FROM correlation_message WHERE message_name = 'invoice.sent'")
    assert requeued == [{"state": "ready", "attempt": 0}] * 5
    assert db.rows("SELECT state FROM correlation_message WHERE id = %s", (dead,)) == [{"state": "dead"}]

    # Pause the stuck hint durably from its page, see it on the pauses page, lift it.
    driver.get(f"{console_url}/ui/hints/order-42")
    driver.find_element(By.ID, "pause-reason").send_keys("checking with the shop")
    click(driver, "pause-hint")
    wait(driver, lambda d: text_of(d, "flash").startswith("paused hint 'order-42'"), "the pause to be reported")
    assert text_of(driver, "blocker-reason") == "the hint is paused by admin (checking with the shop)"
    paused = db.rows("SELECT id, scope, target, reason, created_by FROM correlation_pause")
    assert [(p["scope"], p["target"], p["reason"], p["created_by"]) for p in paused] == [
        ("hint", "order-42", "checking with the shop", "admin")
    ]
    click_nav(driver, "Pauses")
    wait(driver, lambda d: d.find_elements(By.ID, f"lift-{paused[0]['id']}"), "the pause listed")
    shoot(driver, "08-pauses")
    click(driver, f"lift-{paused[0]['id']}")
    wait(driver, lambda d: text_of(d, "flash").startswith("lifted the pause of hint 'order-42'"), "the lift")
    assert db.rows("SELECT id FROM correlation_pause") == []

    # Everything done is in the audit, under the token's name.
    click_nav(driver, "Audit")
    wait(driver, lambda d: d.find_elements(By.ID, "audit"), "the audit page")
    shoot(driver, "09-audit")
    audit = db.rows("SELECT actor, via, action, affected FROM correlation_audit ORDER BY id")
    assert audit == [
        {"actor": "admin", "via": "ui", "action": "messages.requeue", "affected": 5},
        {"actor": "admin", "via": "ui", "action": "pauses.add", "affected": 1},
        {"actor": "admin", "via": "ui", "action": "pauses.remove", "affected": 0},
    ]
    driver.find_element(By.CSS_SELECTOR, "form.who button").click()
    wait(driver, lambda d: d.find_elements(By.ID, "token"), "the login form after logging out")
    driver.get(console_url + "/ui/audit")
    wait(driver, lambda d: d.find_elements(By.ID, "token"), "a logged-out visit to be sent to the login form")


def test_a_read_only_login_sees_everything_and_no_action(
    browser: WebDriver, console_url: str, pg_url: str
) -> None:
    db = Database(pg_url)
    dead = db.insert("invoice.sent", "inv-1", state="dead", error="boom")
    log_in(browser, console_url, READ)
    assert "read-only" in browser.find_element(By.CSS_SELECTOR, "form.who").text
    assert text_of(browser, "count-dead") == "1"
    click_nav(browser, "Dead letters")
    wait(browser, lambda d: row_ids(d.find_element(By.ID, "messages")) == [dead], "the dead letter")
    assert browser.find_elements(By.ID, "bulk-requeue") == []
    browser.get(f"{console_url}/ui/messages/{dead}")
    wait(browser, lambda d: d.find_elements(By.ID, "message"), "the message page")
    assert browser.find_elements(By.ID, "action-requeue") == []
    shoot(browser, "10-read-only-message")


def click_nav(driver: WebDriver, label: str) -> None:
    """Follow a link of the navigation bar and wait for its page."""
    page = driver.find_element(By.TAG_NAME, "html")
    driver.find_element(By.CSS_SELECTOR, "header nav").find_element(By.LINK_TEXT, label).click()
    wait(driver, staleness_of(page), f"the {label} page to replace the last one")
    wait(driver, lambda d: d.find_element(By.CSS_SELECTOR, "header nav a.on").text == label, f"the {label} page")


def test_an_operator_disables_a_schedule_fires_it_by_hand_and_switches_the_scheduler_off(
    browser: WebDriver, console_url: str, pg_url: str
) -> None:
    db = Database(pg_url)
    db.rows(
        "INSERT INTO correlation_schedule (name, cron, message_name, payload) "
        "VALUES ('nightly', '0 0 3 * * ?', 'report.due', '{\"kind\": \"daily\"}')"
    )
    log_in(browser, console_url, WRITE)
    assert text_of(browser, "scheduler") == "on"
    click_nav(browser, "Schedules")
    wait(browser, lambda d: text_of(d, "state-nightly") == "enabled", "the schedule listed")

    click(browser, "toggle-nightly")
    wait(browser, lambda d: text_of(d, "flash") == "disabled schedule 'nightly'", "the schedule to be disabled")
    assert text_of(browser, "state-nightly") == "disabled"
    assert db.rows("SELECT enabled FROM correlation_schedule") == [{"enabled": False}]

    Select(browser.find_element(By.ID, "action-nightly")).select_by_value("pause")
    click(browser, "fire-nightly")
    wait(browser, lambda d: text_of(d, "flash").startswith("fired schedule 'nightly' (pause)"), "the manual fire")
    published = db.rows("SELECT message_name, correlation_hint, headers FROM correlation_message")
    assert len(published) == 1 and published[0]["message_name"] == "report.due"
    assert published[0]["correlation_hint"] == "nightly"
    assert (published[0]["headers"]["action"], published[0]["headers"]["action_type"]) == ("pause", "manual")

    click(browser, "scheduler-switch")
    wait(browser, lambda d: text_of(d, "scheduler-state") == "off", "the scheduler switched off")
    assert db.rows("SELECT enabled FROM correlation_scheduler") == [{"enabled": False}]
    shoot(browser, "11-schedules")
    browser.find_element(By.LINK_TEXT, "nightly").click()
    wait(browser, lambda d: d.find_elements(By.ID, "schedule"), "the schedule's page")
    assert "yes" in text_of(browser, "running")  # its manual message is still in the table
    shoot(browser, "12-schedule")
    audit = db.rows("SELECT actor, via, action FROM correlation_audit ORDER BY id")
    assert [row["action"] for row in audit] == ["schedules.disable", "schedules.fire", "scheduler.disable"]
    assert {(row["actor"], row["via"]) for row in audit} == {("admin", "ui")}


def test_the_overview_charts_draw_what_the_samples_hold_and_move_when_messages_flow(
    browser: WebDriver, console_url: str, pg_url: str
) -> None:
    db = Database(pg_url)
    driver = browser

    base = db.rows("SELECT now() AS now")[0]["now"]  # one clock reading: the intervals are exact

    def sample(seconds_ago: int, replica: str, success: int, **census: float) -> None:
        columns = ["taken_at", "replica", "success", *census]
        values = ", ".join(["%s", "%s", "%s", *["%s"] * len(census)])
        db.rows(f"INSERT INTO correlation_sample ({', '.join(columns)}) VALUES ({values})",
                (base - timedelta(seconds=seconds_ago), replica, success, *census.values()))

    # Twenty minutes of history (the picture), then two replicas' counts 30 s apart, the census holder (pod-a)
    # adding the backlog and the id sequence: the newest step's values are known exactly.
    a_calls = b_calls = inserted = retries = 0
    for n in range(80, 2, -1):
        wave = 1 + (n % 20) / 10
        a_calls, b_calls, inserted = a_calls + int(150 * wave), b_calls + int(90 * wave), inserted + int(260 * wave)
        retries += n % 4
        sample(40 + n * 15, "pod-a-1", a_calls, inserted_total=inserted, ready=int(40 * wave), waiting=3,
               paused=0, dead_messages=n // 30, expired=0, retry=retries,
               oldest_eligible_seconds=wave * 4)
        sample(40 + n * 15, "pod-b-2", b_calls)
    sample(40, "pod-a-1", 0, inserted_total=100, ready=2, waiting=0, paused=0, dead_messages=0, expired=0)
    sample(40, "pod-b-2", 0)
    sample(10, "pod-a-1", 600, inserted_total=1000, ready=12, waiting=1, paused=0, dead_messages=3, expired=0)
    sample(10, "pod-b-2", 300)
    log_in(driver, console_url, READ)

    def latest(chart: str) -> dict[str, Any]:
        figure = driver.find_element(By.ID, chart)
        raw = figure.get_attribute("data-latest")
        return json.loads(raw) if raw else {}

    wait(driver, lambda d: latest("chart-throughput").get("correlated/s") is not None, "the throughput chart")
    for chart in ("chart-throughput", "chart-failures", "chart-backlog", "chart-oldest", "chart-replicas"):
        figure = driver.find_element(By.ID, chart)
        assert figure.find_elements(By.CSS_SELECTOR, "canvas"), f"{chart} has no canvas"
    assert latest("chart-throughput") == {"inserted/s": 30.0, "correlated/s": 30.0}  # 900 in 30 s each
    assert latest("chart-backlog")["ready"] == 12 and latest("chart-backlog")["dead"] == 3
    assert latest("chart-replicas") == {"pod-a-1": 20.0, "pod-b-2": 10.0}
    driver.execute_script("document.getElementById('charts').scrollIntoView();")
    shoot(driver, "10-charts")

    # Messages flow: a newer sample, and the charts follow without a reload.
    driver.execute_script("window.__notReloaded = true;")
    sample(0, "pod-a-1", 1500, inserted_total=1900, ready=0, waiting=0, paused=0, dead_messages=3, expired=0)
    wait(driver, lambda d: latest("chart-backlog").get("ready") == 0, "the backlog chart to move")
    assert latest("chart-throughput")["correlated/s"] != 30.0
    assert driver.execute_script("return window.__notReloaded === true;")

    # The last 24 hours, at coarser steps.
    driver.find_element(By.CSS_SELECTOR, "#charts button[data-window='24h']").click()
    wait(driver, lambda d: d.find_element(By.ID, "charts").get_attribute("data-window") == "24h", "the day window")
    assert latest("chart-backlog")["ready"] == 0
