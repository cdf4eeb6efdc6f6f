"""The /dashboard page in a real headless browser (Debian's chromium through selenium): it polls the
live figures of a server that has run a request and draws them. Skipped, saying why, where no
browser or driver is installed (.ci/run installs them)."""

import shutil

import httpx
import pytest

from moestream.serving.server import Server

KEY = "sk-page"

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER),
                                reason="no chromium and chromedriver (apt-get install chromium chromium-driver)")


@pytest.fixture
def browser():
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()


def _updated(driver, times: int) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, 30).until(lambda d: int(d.find_element("tag name", "body").get_attribute("data-updates")
                                                  or 0) >= times)


def test_the_page_draws_the_live_figures(engine, browser):
    with Server(engine, "tiny", api_key=KEY) as server:
        body = {"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}
        assert httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=60).status_code == 200
        browser.get(f"{server.url}/dashboard?key={KEY}")
        _updated(browser, 2)  # polled twice: it keeps polling
        text = browser.find_element("tag name", "body").text
        assert "updated" in browser.find_element("id", "status").text
        for figure in ("device", "precision", "recall", "TTFT p50", "running", "from disk", "misses on host (off)"):
            assert figure in text
        painted = browser.execute_script(
            "const c = document.getElementById('heatmap'); const d = c.getContext('2d')"
            ".getImageData(0, 0, c.width, c.height).data; let n = 0;"
            "for (let i = 3; i < d.length; i += 4) n += d[i] > 0; return n;")
        assert painted > 0  # the heatmap has cells


def test_without_the_key_the_page_asks_for_it(engine, browser):
    from selenium.common.exceptions import NoAlertPresentException, UnexpectedAlertPresentException
    from selenium.webdriver.support.ui import WebDriverWait

    with Server(engine, "tiny", api_key=KEY) as server:
        browser.get(f"{server.url}/dashboard")
        alert = WebDriverWait(browser, 30, ignored_exceptions=[NoAlertPresentException]).until(
            lambda d: d.switch_to.alert)
        assert "API key" in alert.text
        alert.dismiss()  # no key given: the page stops and says so
        WebDriverWait(browser, 30, ignored_exceptions=[UnexpectedAlertPresentException]).until(
            lambda d: "needs an API key" in d.find_element("id", "status").text)


NARROWEST_CARD_PX = 260  # the grid's minmax(260px, 1fr)


def test_a_tier_s_slots_stay_on_one_line_beside_its_bar_in_the_narrowest_card(engine, browser):
    """'device 416 / 416' was wrapped onto two lines: drawn from the server's own figures with large slot
    counts, each tier's label is one line and its bar stays inside the card, at the narrowest card too."""
    with Server(engine, "tiny", api_key=KEY) as server:
        stats = httpx.get(f"{server.url}/v1/moestream/stats", headers={"Authorization": f"Bearer {KEY}"},
                          timeout=30).json()
        stats["tiers"] = {"device": {"used": 416, "total": 416}, "host": {"used": 1200, "total": 65536}}
        browser.get(f"{server.url}/dashboard?key={KEY}")
        _updated(browser, 1)
        for width in (None, NARROWEST_CARD_PX):
            rows = browser.execute_script("""
                const [stats, width] = arguments;
                if (width) document.querySelector('.grid').style.width = width + 'px';  // one column that wide
                draw(stats);  // measured before the next poll redraws it
                const card = document.getElementById('tiers').closest('.card').getBoundingClientRect();
                return [...document.querySelectorAll('#tiers tr')].map(tr => {
                  const label = document.createRange(); label.selectNodeContents(tr.cells[0]);
                  const bar = tr.cells[1].firstChild.getBoundingClientRect();
                  return [tr.cells[0].textContent, label.getClientRects().length, bar.width > 0,
                          bar.right <= card.right];
                });""", stats, width)
            assert rows == [["device 416 / 416", 1, True, True], ["host 1200 / 65536", 1, True, True]], width
