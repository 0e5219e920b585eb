#!/usr/bin/env python3
"""`weightlift rl`'s report.html as a person sees it, laid out by a real browser (headless
Chromium): a short run of the real command, then the page loaded with a probe script that
measures what the browser drew, and a screenshot.

What the page must be (issue 39: a dashboard, not a dump):
- a headline first: held-out accuracy before and after RL, the run's time, the step time and
  the sync's share, as cards;
- every plot's text inside its picture: no legend, label or title clipped, and no two legend
  entries on top of each other;
- the time split per step stacked (one filled band per phase);
- the events in the order they happened (warm start before RL, by step);
- every figure with its unit: no number printed with more than four significant digits.

Exit code 77 (counted as skipped, not passed) when Chromium is not installed; scripts/setup.sh
installs it. Usage: rl_report.py <weightlift binary> <directory for the screenshot>"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

BROWSER = shutil.which("chromium-headless-shell") or shutil.which("chromium")

# Runs in the page once it has loaded; leaves what it measured in <body data-probe="...">.
PROBE = r"""
<script>
window.addEventListener('load', () => {
  const out = {clipped: [], overlapping: [], svgs: 0, bands: 0, cards: [], events: [],
               figures: []};
  for (const svg of document.querySelectorAll('svg')) {
    ++out.svgs;
    const box = svg.getBoundingClientRect();
    const texts = [...svg.querySelectorAll('text')];
    for (const t of texts) {
      const r = t.getBoundingClientRect();
      if (r.left < box.left - 0.5 || r.right > box.right + 0.5 || r.top < box.top - 0.5 ||
          r.bottom > box.bottom + 0.5)
        out.clipped.push(t.textContent);
    }
    // The legend: the text below the plot's frame (the first rect is the background).
    const frame = svg.querySelectorAll('rect')[1].getBoundingClientRect();
    const legend = texts.filter(t => t.getBoundingClientRect().top > frame.bottom + 20);
    for (let i = 0; i < legend.length; ++i)
      for (let j = i + 1; j < legend.length; ++j) {
        const a = legend[i].getBoundingClientRect(), b = legend[j].getBoundingClientRect();
        if (a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom)
          out.overlapping.push(legend[i].textContent + ' / ' + legend[j].textContent);
      }
    out.bands += svg.querySelectorAll('polygon').length;
  }
  out.cards = [...document.querySelectorAll('.card .big')].map(e => e.textContent);
  out.events = [...document.querySelectorAll('ol li')].map(e => e.textContent);
  out.figures = [...document.querySelectorAll('table td:last-child')].map(e => e.textContent);
  out.first = document.body.children[1] ? document.body.children[1].className : '';
  out.cards_top = document.querySelector('.cards').getBoundingClientRect().top;
  out.first_plot_top = document.querySelector('svg').getBoundingClientRect().top;
  document.body.setAttribute('data-probe', JSON.stringify(out));
});
</script>
"""


def run_rl(exe, out):
    # Worker 1 is killed after step 3's weight update and restarted by the launcher: the run
    # has events to list (lost, rejoined).
    cmd = [exe, "launch", "-n", "3", "--restart-failed", "1", "--", exe, "--threads", "1", "rl",
           "--preset", "tiny", "--task", "sort", "--difficulty", "2", "--sft-steps", "8",
           "--sft-eval-every", "4", "--steps", "12", "--eval-every", "6", "--prompts", "4",
           "--group", "4", "--eval-problems", "8", "--format-reward", "0.5", "--timeout", "30",
           "--kill-worker-after-sync", "3", "--out", out]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        sys.exit(f"FAIL the run: {r.returncode}\n{r.stdout}\n{r.stderr}")


def browse(html, *flags):
    r = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--window-size=900,1400", "--virtual-time-budget=5000", *flags,
                        "file://" + html], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        sys.exit(f"FAIL {BROWSER} {' '.join(flags)}: {r.returncode}\n{r.stderr[-2000:]}")
    return r.stdout


def main():
    exe, shots = sys.argv[1], sys.argv[2]
    if BROWSER is None:
        print("SKIP no headless Chromium (scripts/setup.sh installs chromium-headless-shell)")
        sys.exit(77)
    failures = []

    def check(ok, what):
        print(("ok   " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

    with tempfile.TemporaryDirectory(prefix="wl_rl_report_") as d:
        out = os.path.join(d, "run")
        run_rl(exe, out)
        page = open(os.path.join(out, "report.html")).read()
        probed = os.path.join(d, "probed.html")
        with open(probed, "w") as f:
            f.write(page.replace("</body>", PROBE + "</body>"))
        dom = browse(probed, "--dump-dom")
        m = re.search(r'data-probe="([^"]*)"', dom)
        if not m:
            sys.exit("FAIL the probe left nothing: the page did not load in the browser")
        p = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&")
                       .replace("&lt;", "<").replace("&gt;", ">"))
        os.makedirs(shots, exist_ok=True)
        shot = os.path.join(shots, "rl_report.png")
        browse(os.path.join(out, "report.html"), "--screenshot=" + shot,
               "--window-size=900,3800")
        check(os.path.getsize(shot) > 20000, f"a screenshot of the page: {shot}")

    check(p["first"] == "setup" and p["cards_top"] < p["first_plot_top"],
          "the headline comes before the plots")
    check(len(p["cards"]) == 4 and "\u2192" in p["cards"][0] and "%" in p["cards"][0],
          f"headline cards: {p['cards']}")
    check(re.fullmatch(r"[\d.]+ (s|ms)|\d+m\d\ds|\d+h\d\dm", p["cards"][1]) is not None,
          f"the run's time with its unit: {p['cards'][1]!r}")
    check(p["svgs"] >= 5, f"{p['svgs']} plots")
    check(not p["clipped"], f"no text drawn outside its picture: {p['clipped']}")
    check(not p["overlapping"], f"no legend entries on top of each other: {p['overlapping']}")
    check(p["bands"] >= 3, f"the time per step stacked, one band per phase: {p['bands']} bands")
    order = [(0 if e.startswith("sft") else 1, int(re.search(r"step (\d+)", e).group(1)))
             for e in p["events"] if re.search(r"step (\d+)", e)]
    check(len(order) >= 2 and order == sorted(order), f"events in time order: {p['events']}")
    long_numbers = [f for f in p["figures"] if re.search(r"\d\.\d{5,}", f)]
    check(not long_numbers, f"figures with their units, not raw floats: {long_numbers}")
    check(any(f.endswith(" ms") for f in p["figures"]) and any(f.endswith("%") for f in
                                                                p["figures"]),
          "times in ms and shares in %")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
