"""In Jupyter, GradStats and ActivationStats render as an HTML table of their rows."""
import html.parser

import torch

import gradfuse


class _Cells(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.rows, self._row, self._in_cell = [], None, False

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self._row = []
        elif tag in ("td", "th"):
            self._in_cell = True
            self._row.append("")

    def handle_endtag(self, tag):
        if tag == "tr":
            self.rows.append(self._row)
        elif tag in ("td", "th"):
            self._in_cell = False

    def handle_data(self, data):
        if self._in_cell:
            self._row[-1] += data


def _table(text: str) -> list[list[str]]:
    parser = _Cells()
    parser.feed(text)
    return parser.rows


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def test_grad_stats_html_table_holds_every_row_and_its_values():
    m = _model()
    m(torch.randn(5, 3)).pow(2).sum().backward()
    s = gradfuse.stats(m)
    rows = _table(s._repr_html_())
    head, body = rows[0], rows[1:]
    assert head[:3] == ["name", "numel", "l2"]
    assert sorted(r[0] for r in body) == sorted(s.names)
    d = s.to_dict()["params"]
    for r in body:
        assert float(r[2]) == float(f"{d[r[0]]['l2']:.4g}")
    assert [float(r[2]) for r in body] == sorted((float(r[2]) for r in body), reverse=True)


def test_html_escapes_names_and_limits_rows():
    grads = {f"<w{i}>": torch.full((3,), float(i)) for i in range(5)}
    s = gradfuse.tensor_stats(grads)
    text = s._repr_html_(max_rows=2)
    assert "&lt;w4&gt;" in text and "<w4>" not in text
    assert len(_table(text)) == 1 + 2 and "3 more rows" in text


def test_activation_stats_html_has_their_columns():
    m = _model()
    with gradfuse.capture_activations(m) as cap:
        m(torch.randn(5, 3)).sum().backward()
    head = _table(cap.forward._repr_html_())[0]
    assert {"std", "dead_units", "module"} <= set(head)
