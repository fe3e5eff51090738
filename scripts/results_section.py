"""One generated section of a markdown document (docs/RESULTS.md): the experiment report scripts
(experiment_wan_report.py, experiment_overlap_report.py) write their section between begin/end
markers that name the section and the script that made it, to a file of its own and into the
document, replacing the section there or appending it. Python 3 standard library only."""
import datetime
import os
import re


def run_date(paths):
    """The UTC date (YYYY-MM-DD) of the newest of `paths` (the runs a section reports): a report
    regenerated later still names the day its runs were made."""
    newest = max(os.path.getmtime(p) for p in paths)
    return datetime.datetime.fromtimestamp(newest, datetime.timezone.utc).strftime("%Y-%m-%d")


def _begin_prefix(name):
    return f"<!-- begin section: {name} ("


def markers(name, script):
    """The (begin, end) marker lines of section `name`, made by `script`."""
    return (f"{_begin_prefix(name)}{script}) -->", f"<!-- end section: {name} -->")


def add_output_args(parser):
    """The options every report takes: --out (the section's own file) and --doc (the document
    that holds it)."""
    parser.add_argument("--out", required=True, help="the section's own markdown file")
    parser.add_argument("--doc", required=True, help="the document the section goes into")


def write_section(name, text, out, doc):
    """Writes `text` (which starts and ends with section `name`'s markers) to `out` and puts it
    into `doc`."""
    with open(out, "w") as f:
        f.write(text)
    body = open(doc).read() if os.path.exists(doc) else ""
    # Whichever script made the section there, it is replaced.
    pat = re.compile(re.escape(_begin_prefix(name)) + ".*?" +
                     re.escape(markers(name, "")[1]) + "\n?", re.S)
    body = pat.sub(lambda _: text, body) if pat.search(body) else (
        body.rstrip("\n") + "\n\n" + text)
    with open(doc, "w") as f:
        f.write(body)
    print(f"wrote {out} and its section of {doc}")
