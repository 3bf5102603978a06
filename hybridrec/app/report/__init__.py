"""The run report and summary: the time series the launcher samples (series), their plots (plots), the HTML
page and the numbers formatted for people (page), the writer that puts them in the run directory (write), and
the summary table `hybridrec run` prints at the end (summary_table).

`python -m hybridrec.app.report RUN_DIR [--screenshot PNG]` re-renders a run's report (__main__)."""
