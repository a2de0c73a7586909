"""End to end: the playground page in a real headless Chromium, driven with selenium, against a live server.

Skipped unless Debian's `chromium` and `chromium-driver` and the `selenium` package are installed (CI installs
them; see the README). Chromium runs with flags that keep it from reaching for the network on an offline
machine. `scripts/playground_screenshot.py` drives the same page for the docs' screenshot.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from stemlm.serve import Playground

from .conftest import PROMPT, SOURCE, TARGET, running_server

pytestmark = pytest.mark.browser
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if CHROMIUM is None or DRIVER is None:
    pytest.skip("needs Debian's chromium and chromium-driver", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-dev-shm-usage",
    "--window-size=1280,1500",
)


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def stem_site(stem_ckpt, tmp_path_factory):
    pg = Playground.load(stem_ckpt, save_dir=tmp_path_factory.mktemp("saved"))
    with running_server(pg) as url:
        yield url, pg
    pg.close()


def wait(driver, condition, timeout=60):
    return WebDriverWait(driver, timeout).until(lambda d: condition(d))


def open_page(driver, url: str, prompt: str = PROMPT) -> None:
    driver.get(url + "/")
    wait(driver, lambda d: "ffn=" in d.find_element(By.ID, "model-info").text)
    box = driver.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(prompt)


def by_id(driver, name):
    return driver.find_element(By.ID, name)


def set_value(driver, name: str, value: str) -> None:
    field = by_id(driver, name)
    field.clear()
    field.send_keys(value)


def error_text(driver) -> str:
    wait(driver, lambda d: by_id(d, "error").is_displayed())
    return by_id(driver, "error-text").text


def apply_edit(driver) -> None:
    by_id(driver, "edit-btn").click()
    wait(driver, lambda d: by_id(d, "edit-btn").is_enabled())


def test_generate_streams_the_completion(browser, stem_site):
    url, pg = stem_site
    open_page(browser, url)
    set_value(browser, "max-new-tokens", "6")
    by_id(browser, "generate-btn").click()
    wait(browser, lambda d: by_id(d, "generate-output").get_attribute("data-done") == "1")
    sampling = dict(max_new_tokens=6, greedy=True, temperature=0.8, top_k=50, top_p=0.95, seed=0)
    expected = pg.tokenizer.decode(list(pg.stream(pg.encode(PROMPT), sampling)))
    completion = browser.find_element(By.CSS_SELECTOR, "#generate-output .completion").get_attribute("textContent")
    assert completion == expected
    assert "6 tokens in" in by_id(browser, "generate-stats").text
    assert not by_id(browser, "error").is_displayed()


def test_edit_toggle_changes_the_output_not_the_prompt(browser, stem_site):
    url, pg = stem_site
    open_page(browser, url)
    by_id(browser, "tab-edit").click()
    set_value(browser, "edit-source", SOURCE)
    set_value(browser, "edit-target", TARGET)
    Select(by_id(browser, "edit-strategy")).select_by_value("average")  # the strategy the fixture promises for
    apply_edit(browser)
    assert not by_id(browser, "error").is_displayed(), by_id(browser, "error-text").text
    output = by_id(browser, "edit-output")
    assert output.get_attribute("data-state") == "on"
    edited = (output.text, by_id(browser, "edit-top").text)
    edited_chips = [c.text.strip() for c in browser.find_elements(By.CSS_SELECTOR, "#edit-tokens .chip.edited")]
    assert edited_chips == [SOURCE]
    assert len(browser.find_elements(By.CSS_SELECTOR, ".top-table")) == 1  # one top-k table, not one per side
    assert by_id(browser, "edit-top-title").text == "Next token: the 8 most likely with the edit"

    by_id(browser, "edit-toggle").click()
    wait(browser, lambda d: by_id(d, "edit-output").get_attribute("data-state") == "off")
    plain = (by_id(browser, "edit-output").text, by_id(browser, "edit-top").text)
    assert plain[0] != edited[0]  # the greedy continuation changes with this model (see conftest)
    assert plain[1] != edited[1]  # and so do the shown next-token probabilities
    assert by_id(browser, "prompt").get_attribute("value") == PROMPT
    assert plain[0].startswith(PROMPT) and edited[0].startswith(PROMPT)
    assert browser.find_elements(By.CSS_SELECTOR, "#edit-tokens .chip.edited") == []

    by_id(browser, "edit-toggle").click()
    wait(browser, lambda d: by_id(d, "edit-output").get_attribute("data-state") == "on")
    assert (by_id(browser, "edit-output").text, by_id(browser, "edit-top").text) == edited
    assert by_id(browser, "before-text").text != by_id(browser, "after-text").text


def test_a_running_request_shows_what_runs(browser, stem_site):
    url, _ = stem_site
    open_page(browser, url)
    by_id(browser, "tab-edit").click()
    set_value(browser, "edit-source", SOURCE)
    set_value(browser, "edit-target", TARGET)
    browser.execute_script(  # record every text the indicator shows while it is visible
        "window.busySeen = []; const b = document.getElementById('busy');"
        "new MutationObserver(() => { if (!b.hidden) window.busySeen.push(b.textContent); })"
        ".observe(b, {attributes: true, childList: true, characterData: true, subtree: true});"
    )
    apply_edit(browser)
    assert browser.execute_script("return window.busySeen")[0] == "Apply edit: working… 0 s"
    assert not by_id(browser, "busy").is_displayed()


def test_save_of_shared_subwords_asks_first(browser, stem_site):
    url, pg = stem_site
    open_page(browser, url)
    by_id(browser, "tab-edit").click()
    set_value(browser, "edit-source", SOURCE)
    set_value(browser, "edit-target", TARGET)
    set_value(browser, "save-name", "asked")
    token_id = pg.tokenizer.encode(" " + SOURCE, add_special_tokens=False).ids[0]
    for answer in ("save-cancel-btn", "save-confirm-btn"):
        by_id(browser, "save-btn").click()
        wait(browser, lambda d: by_id(d, "save-confirm").is_displayed())
        assert by_id(browser, "save-tokens").text == f"'ĠFrance' (id {token_id}): also in 1 word: France's"
        assert not by_id(browser, "error").is_displayed()
        assert not (pg.save_dir / "asked").exists()  # asked, not saved
        by_id(browser, answer).click()
        wait(browser, lambda d: not by_id(d, "save-confirm").is_displayed())
    wait(browser, lambda d: by_id(d, "save-status").text.startswith("saved "))
    assert by_id(browser, "save-status").text == f"saved {pg.save_dir / 'asked'}"
    assert (pg.save_dir / "asked" / "edits.json").is_file()
    assert "France's" in by_id(browser, "save-tokens").text  # what changed stays listed after the save


def test_clicking_tokens_picks_the_source_span(browser, stem_site):
    url, _ = stem_site
    open_page(browser, url)
    by_id(browser, "tab-edit").click()
    chip = wait(browser, lambda d: [c for c in d.find_elements(By.CSS_SELECTOR, ".chip") if c.text.strip() == SOURCE])
    position = chip[0].get_attribute("data-pos")
    chip[0].click()
    assert by_id(browser, "edit-source").get_attribute("value") == SOURCE
    assert [c.get_attribute("data-pos") for c in browser.find_elements(By.CSS_SELECTOR, ".chip.picked")] == [position]
    set_value(browser, "edit-target", TARGET)
    apply_edit(browser)
    assert by_id(browser, "edit-summary").text.startswith(
        f"Rows of {TARGET} at {SOURCE}'s token (position {position}), STEM layers 1 and 2; the largest change"
    )


def test_edit_choices_in_words_with_tooltips(browser, stem_site):
    url, _ = stem_site
    open_page(browser, url)
    by_id(browser, "tab-edit").click()
    pads = [o.text for o in Select(by_id(browser, "edit-pad")).options]
    assert pads == [
        "default: end-of-text row (saved edits: source's own row)",
        "end-of-text row",
        "source's own row",
        "zero row",
    ]
    assert Select(by_id(browser, "edit-strategy")).first_selected_option.text == "automatic"
    pad_tip = by_id(browser, "edit-pad-label").get_attribute("title")
    assert pad_tip.endswith(
        "a saved edit keeps the source's own row, since rewriting a padded token everywhere "
        "would change every other word sharing it."
    )
    Select(by_id(browser, "edit-strategy")).select_by_value("left_pad")
    strategy_tip = by_id(browser, "edit-strategy-label").get_attribute("title")
    assert "target at the end, padding first (left_pad): longer source" in strategy_tip


@pytest.mark.parametrize(
    "prompt, source, target, message",
    [
        ("", SOURCE, TARGET, "prompt is empty"),
        (PROMPT, "Spain", TARGET, "does not occur in the prompt"),
        (PROMPT, SOURCE, "", "target is empty"),
    ],
)
def test_bad_edit_input_is_shown_in_the_page(browser, stem_site, prompt, source, target, message):
    url, _ = stem_site
    open_page(browser, url, prompt)
    by_id(browser, "tab-edit").click()
    set_value(browser, "edit-source", source)
    set_value(browser, "edit-target", target)
    apply_edit(browser)
    assert message in error_text(browser)
    assert "Traceback" not in browser.page_source


def test_empty_prompt_generation_is_shown_in_the_page(browser, stem_site):
    url, _ = stem_site
    open_page(browser, url, "")
    by_id(browser, "generate-btn").click()
    assert "prompt is empty" in error_text(browser)


def test_heat_map_and_nearest_tokens(browser, stem_site):
    url, pg = stem_site
    open_page(browser, url)
    by_id(browser, "tab-see").click()
    by_id(browser, "see-btn").click()
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#heatmap td.cell"))
    cells = browser.find_elements(By.CSS_SELECTOR, "#heatmap td.cell")
    assert len(cells) == len(pg.model.token_tables()) * len(pg.encode(PROMPT))
    header = [h for h in browser.find_elements(By.CSS_SELECTOR, "#heatmap th.tok") if h.text.strip() == SOURCE][0]
    ActionChains(browser).move_to_element(header).perform()
    wait(browser, lambda d: f'nearest to " {SOURCE}"' in by_id(d, "nearest").text)
    assert "layer 1" in by_id(browser, "nearest").text and "embed_tokens" in by_id(browser, "nearest").text


def test_dense_checkpoint_edit_is_refused_in_the_page(browser, dense_ckpt):
    pg = Playground.load(dense_ckpt)
    try:
        with running_server(pg) as url:
            open_page(browser, url)
            by_id(browser, "tab-edit").click()
            assert "no STEM tables" in by_id(browser, "edit-notice").text
            set_value(browser, "edit-source", SOURCE)
            set_value(browser, "edit-target", TARGET)
            apply_edit(browser)
            assert "no STEM tables" in error_text(browser)
    finally:
        pg.close()


def test_host_tables_show_cache_statistics(browser, stem_ckpt):
    pg = Playground.load(stem_ckpt, tables="host", cache_rows=16)
    try:
        with running_server(pg) as url:
            open_page(browser, url)
            set_value(browser, "max-new-tokens", "4")
            by_id(browser, "generate-btn").click()
            wait(browser, lambda d: by_id(d, "generate-output").get_attribute("data-done") == "1")
            stats = pg.offloaded.stats()
            text = by_id(browser, "cache-stats").text
            assert "device row cache 16 rows (lfu)" in text
            assert f"hits {stats.hits} / {stats.unique_ids}" in text and f"misses {stats.misses}" in text
    finally:
        pg.close()


def test_screenshot_script_writes_the_edited_page(stem_ckpt, tmp_path):
    out = tmp_path / "page.png"
    script = Path(__file__).resolve().parents[2] / "scripts" / "playground_screenshot.py"
    done = subprocess.run(
        [sys.executable, str(script), str(stem_ckpt), "--out", str(out)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out}: 'The capital of Spain is")
    header = out.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">I", header[16:20]) == (1280,)  # IHDR width
