"""benchmarks/latency.py's reference round trip: a one-line file from Python's http.server in a process of its
own, read as the benchmark reads a streamed first token, and the server gone once the benchmark is done."""

import urllib.error
import urllib.request

import pytest

from benchmarks.latency import first_data_line, trivial_http_server


def test_the_reference_server_answers_a_data_line_and_stops_with_the_benchmark():
    with trivial_http_server() as url:
        times = [first_data_line(urllib.request.Request(url)) for _ in range(3)]
        assert all(0 < first - sent < 5 for sent, first in times)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)
