"""Rendering: what a comparison looks like. Tables built from a comparison (tables, suites), rendered as rich,
markdown, csv or json (formats), the HTML report (html), the plots (plots) and the second process that draws
some of them (plotworker). Nothing below imports this room; the CLI and the sweep's report files do."""
