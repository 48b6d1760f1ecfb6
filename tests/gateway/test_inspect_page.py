"""The /inspect page in a real headless Chromium (tests/fixtures/browser.py) in front of the real
gateway and Triton: random tokens from a seed are inspected, the drawn heatmaps agree with
`POST /v1/inspect` for the same hidden states (the request the page shows it sent; a hovered cell's
tooltip; a cell's pixel against the documented color scale, computed here), the statistics are tabled,
a malformed input shows the error and the page still works after it. In front of a whole model with a
tokenizer (tests/gateway/conftest.py `whole`) the page takes text and labels the axes with its tokens.

The screenshot goes to a temporary file; `REFRESH_DOCS_IMAGES=1` writes it over
docs/images/inspect-page.png (the README's) instead, to refresh that image on purpose:
`REFRESH_DOCS_IMAGES=1 pytest tests/gateway/test_inspect_page.py`."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from tests.gateway.conftest import KEYS, WHOLE_KEY

DOCS_IMAGE = Path(__file__).resolve().parents[2] / "docs" / "images" / "inspect-page.png"
WAIT_S = 60
LOW, HIGH = (255, 255, 255), (8, 48, 107)  # the page's scale: white at 0, dark blue at the largest weight


def expected_color(weight: float, top: float) -> list[int]:
    """The page's color of `weight` when `top` is the largest weight shown: the square root of
    weight / top (as `python -m export inspect` draws), each channel rounded half up like Math.round."""
    t = math.sqrt(min(1.0, max(0.0, weight / top)))
    return [math.floor(low + (high - low) * t + 0.5) for low, high in zip(LOW, HIGH, strict=True)]


def screenshot_path(tmp_path: Path) -> Path:
    """docs/images/inspect-page.png when refreshing it on purpose (REFRESH_DOCS_IMAGES=1), else a temporary file."""
    return DOCS_IMAGE if os.environ.get("REFRESH_DOCS_IMAGES") == "1" else tmp_path / "inspect-page.png"


def fill(browser, element_id: str, text: str) -> None:
    element = browser.find_element("id", element_id)
    element.clear()
    element.send_keys(text)


def inspect(browser) -> None:
    browser.find_element("id", "inspect").click()
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, WAIT_S).until(
        lambda d: d.find_element("tag name", "body").get_attribute("data-state") in ("done", "error")
    )


@pytest.fixture(scope="module")
def page(browser, gateway):
    browser.get(f"{gateway.url}/inspect")
    return browser


def test_the_page_draws_the_apis_maps_and_survives_a_bad_input(page, api, served_cfg, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains

    fill(page, "key", KEYS[0])
    fill(page, "tokens", "8")
    fill(page, "seed", "7")
    inspect(page)
    assert page.find_element("id", "error").get_attribute("hidden"), page.find_element("id", "error").text
    sent = json.loads(page.find_element("id", "request-body").get_attribute("textContent"))
    assert len(sent["hidden_states"]) == 8 and len(sent["hidden_states"][0]) == served_cfg.d_model
    answer = api.post("/v1/inspect", json=sent).json()  # the same hidden states, from Python
    canvases = page.find_elements("css selector", "#maps canvas[data-layer][data-head]")
    assert len(canvases) == served_cfg.n_layers * served_cfg.n_heads == answer["layers"] * answer["heads"]

    layer, head, query, key = served_cfg.n_layers - 1, served_cfg.n_heads // 2, 6, 3
    canvas = page.find_element("css selector", f'#maps canvas[data-layer="{layer}"][data-head="{head}"]')
    cell = int(canvas.get_attribute("data-cell"))
    weight = answer["maps"][layer][head][query][key]
    width, height = canvas.size["width"], canvas.size["height"]
    x, y = key * cell + cell // 2, query * cell + cell // 2
    ActionChains(page).move_to_element_with_offset(canvas, x - width // 2, y - height // 2).perform()
    tooltip = page.find_element("id", "tooltip")
    assert tooltip.is_displayed()
    assert tooltip.text == f"layer {layer}, head {head}, query {query}, key {key}: weight {weight:.4f}", tooltip.text

    drawn = page.execute_script(
        "const [c, x, y] = arguments; return Array.from(c.getContext('2d').getImageData(x, y, 1, 1).data)",
        canvas,
        x,
        y,
    )
    top = max(w for maps in answer["maps"] for rows in maps for row in rows for w in row)
    assert 0 < weight < top, (weight, top)  # strictly inside: where a linear scale would give another color
    expected = expected_color(weight, top)
    assert drawn[:3] == expected and drawn[3] == 255, (drawn, expected, weight, top)
    assert page.find_element("id", "legend-high").text == f"{top:.4f}"  # the scale the API's numbers set

    rows = page.find_elements("css selector", "#stats tr")
    assert len(rows) == 1 + served_cfg.n_layers * served_cfg.n_heads
    first = answer["statistics"][0]["heads"][0]
    cells = [td.text for td in rows[1].find_elements("tag name", "td")]
    assert cells[:3] == ["0", "0", f"{first['entropy']:.3f}"], cells
    page.execute_script("window.scrollTo(0, 0)")  # the whole page from its top, the tooltip still shown
    screenshot = screenshot_path(tmp_path)
    assert page.save_screenshot(str(screenshot)), screenshot

    fill(page, "hidden", "[[1.0, 2.0")  # malformed JSON pasted
    inspect(page)
    error = page.find_element("id", "error")
    assert error.is_displayed() and "hidden states: not valid JSON" in error.text, error.text

    fill(page, "hidden", "[[1.0, 2.0]]")  # JSON, but not the model's width: the API's own message
    inspect(page)
    assert "invalid_input" in error.text and "hidden_states" in error.text, error.text

    page.find_element("id", "hidden").clear()  # and the page still works
    fill(page, "seed", "8")
    inspect(page)
    assert not error.is_displayed()
    assert len(page.find_elements("css selector", "#maps canvas[data-layer][data-head]")) == len(canvases)


def test_a_missing_key_is_said_on_the_page(page):
    fill(page, "key", "")
    page.find_element("id", "hidden").clear()
    inspect(page)
    error = page.find_element("id", "error")
    assert error.is_displayed() and "401 unauthorized" in error.text and "API key is required" in error.text, error.text


TEXT = "the cat 你\nsat"  # spaces, a newline, and a character the byte-level BPE splits into bytes


def readable(data: bytes) -> str:
    """A token's label as the page documents it: its text with a space as an open box and a newline as \\n, or,
    for bytes that are no whole character, their escapes."""
    try:
        return data.decode("utf-8").replace(" ", "\u2423").replace("\n", "\\n")
    except UnicodeDecodeError:
        return "".join(f"\\x{byte:02x}" for byte in data)


def test_a_whole_models_text_is_inspected_with_its_tokens_on_the_axes(browser, whole, artifact_dir):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.support.ui import WebDriverWait

    from client.text import TextModel
    from tests.fixtures.triton import WHOLE_ARTIFACT

    api, model = whole
    tokenizer = TextModel.from_folder(artifact_dir(WHOLE_ARTIFACT))
    browser.get(f"{api.base_url}/inspect")
    fill(browser, "key", WHOLE_KEY)
    browser.find_element("id", "seed").click()  # the key is given (its change): the page asks which model it is
    WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element("id", "text").is_displayed())
    fill(browser, "text", TEXT)
    inspect(browser)
    assert browser.find_element("id", "error").get_attribute("hidden"), browser.find_element("id", "error").text
    assert json.loads(browser.find_element("id", "request-body").get_attribute("textContent")) == {"text": TEXT}

    ids = tokenizer.encode(TEXT)
    expected = [readable(tokenizer.token_bytes(token)) for token in ids]
    assert any(label.startswith("\\x") for label in expected)  # a piece of a character, drawn as its bytes
    layer, head = model.cfg.n_layers - 1, 1
    panel = browser.find_element("css selector", f'#maps canvas[data-layer="{layer}"][data-head="{head}"]')
    box = panel.find_element("xpath", "..")
    for axis in ("query", "key"):
        names = box.find_elements("css selector", f".{axis}-labels span")
        assert [name.get_attribute("textContent") for name in names] == expected, axis

    cell = int(panel.get_attribute("data-cell"))
    query, key = len(ids) - 1, 1
    x, y = key * cell + cell // 2, query * cell + cell // 2
    # the whole panel in view: Selenium scrolls only to the panel's center, and the cell may be below it
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", panel)
    ActionChains(browser).move_to_element_with_offset(
        panel, x - panel.size["width"] // 2, y - panel.size["height"] // 2
    ).perform()
    weight = api.post("/v1/inspect", json={"input_ids": ids}).json()["maps"][layer][head][query][key]
    tooltip = browser.find_element("id", "tooltip").text
    assert tooltip == (
        f"layer {layer}, head {head}, query {query} ({expected[query]}), key {key} ({expected[key]}): "
        f"weight {weight:.4f}"
    ), tooltip

    repeated_ids_are_tabled_with_the_apis_statistics(browser, api)


def repeated_ids_are_tabled_with_the_apis_statistics(browser, api) -> None:
    """Random ids repeated: the page sends N ids twice over, tables the induction share the API answers and lists
    the heads its roles name."""
    fill(browser, "text", "")
    browser.find_element("id", "repeat").click()
    fill(browser, "tokens", "6")
    inspect(browser)
    assert browser.find_element("id", "error").get_attribute("hidden"), browser.find_element("id", "error").text
    sent = json.loads(browser.find_element("id", "request-body").get_attribute("textContent"))
    ids = sent["input_ids"]
    assert len(ids) == 12 and ids[:6] == ids[6:] and 0 not in ids, ids
    answer = api.post("/v1/inspect", json=sent).json()
    header = [th.text for th in browser.find_elements("css selector", "#stats tr th")]
    assert header[-1] == "induction", header
    last = browser.find_elements("css selector", "#stats tr")[-1].find_elements("tag name", "td")
    assert last[-1].text == f"{answer['statistics'][-1]['heads'][-1]['induction_share']:.3f}"
    items = browser.find_elements("css selector", "#roles li")
    assert [item.get_attribute("data-role") for item in items] == [role["role"] for role in answer["roles"]]
    for item, role in zip(items, answer["roles"], strict=True):
        named = ", ".join(f"L{h['layer']}H{h['head']} ({h['share']:.2f})" for h in role["heads"]) or "none found"
        assert item.text.endswith(f"): {named}"), (item.text, role)


def test_the_page_loads_nothing_from_outside_the_gateway():
    static = Path(__file__).resolve().parents[2] / "serving" / "gateway" / "static"
    for file in static.iterdir():
        text = file.read_text()
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, file.name


def test_a_host_without_the_browser_is_told_what_is_missing(monkeypatch, tmp_path):
    from tests.fixtures import browser

    monkeypatch.setattr(browser, "CHROMEDRIVER", tmp_path / "chromedriver")
    assert browser.missing() == [f"{tmp_path / 'chromedriver'} (Debian's chromedriver)"]
