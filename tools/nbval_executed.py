"""A pytest plugin: keep the notebooks that nbval executed, with their outputs.

    python -m pytest --nbval-lax --nbval-current-env chapters \
        -p tools.nbval_executed --nbval-executed-dir=_build/executed

For every notebook whose code cells all passed, writes a copy with the outputs of this run to
<dir>/<path relative to pytest's rootdir> (chapters/03_kv_cache.ipynb ->
_build/executed/chapters/03_kv_cache.ipynb). The source notebooks are never written. The
website build (`make site-from-nbval`, tools/stage_executed_book.py) renders these copies, so
`make test` executes every chapter once.

The outputs are what Jupyter Book's own execution (nbclient) stores: nbval reads every kernel
message of a cell; this plugin records them and, once the cell has passed, replays the cell's
messages through nbclient's message handling. So display updates (`display_id`),
`clear_output` and ipywidgets (Output widgets, the widget state in the notebook's metadata)
come out as in `make site`. The cells run with store_history=True, as in Jupyter (nbval's
default, False, loses the `;` that hides a cell's result). Without the option the plugin
does nothing.
"""
from __future__ import annotations

import copy
from pathlib import Path

import nbformat
import pytest

OPTION = "--nbval-executed-dir"


def pytest_addoption(parser):
    parser.addoption(OPTION, default=None, metavar="DIR",
                     help="write each notebook whose cells all passed under nbval, with the "
                          "outputs of this run, into DIR (the source notebooks are unchanged)")


class _NoKernel:
    """nbclient's Output-widget mimic sends its state back to the kernel; a replay has none."""

    class _Channel:
        def send(self, msg):
            pass

    class _Session:
        def msg(self, *args, **kwargs):
            return {}

    def __init__(self):
        self.session = self._Session()
        self.shell_channel = self._Channel()


class ExecutedNotebook:
    """A copy of one notebook that collects the outputs of its passing cells."""

    def __init__(self, nb, target: Path):
        from nbclient import NotebookClient

        self.nb = copy.deepcopy(nb)
        self.target = target
        self.code_cells = [i for i, c in enumerate(self.nb.cells) if c.cell_type == "code"]
        self.passed: set[int] = set()
        self.failed = False
        # only its message handling is used; timings would go into the cells' metadata
        self.client = NotebookClient(self.nb, record_timing=False)
        self.client.kc = _NoKernel()

    def add(self, index: int, messages: list[dict]) -> None:
        """Replay the kernel messages of the passing cell `index`, as nbclient does."""
        from nbclient.exceptions import CellExecutionComplete

        cell = self.nb.cells[index]
        cell.outputs = []
        cell.execution_count = None
        self.client.clear_before_next_output = False
        parent = messages[-1]["parent_header"].get("msg_id")  # nbval stops at the cell's idle
        for msg in messages:
            if msg["parent_header"].get("msg_id") != parent:
                continue
            try:
                self.client.process_message(msg, cell, index)
            except CellExecutionComplete:
                break
        self.passed.add(index)

    def complete(self) -> bool:
        return not self.failed and self.passed == set(self.code_cells)

    def write(self) -> None:
        # nbval executes with store_history=False (no execution counts): number the cells
        # that ran as a top-to-bottom run does; empty cells are not run (as in nbclient)
        count = 0
        for i in self.code_cells:
            cell = self.nb.cells[i]
            cell.execution_count = None
            if cell.source.strip():
                count += 1
                cell.execution_count = count
                for out in cell.outputs:
                    if out.output_type == "execute_result":
                        out.execution_count = count
        self.client.set_widgets_metadata()
        self.target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(self.nb, str(self.target))


class Recorder:
    def __init__(self, config, folder: Path):
        self.config = config
        self.folder = folder
        self.notebooks: dict[str, ExecutedNotebook] = {}  # by the notebook's node id

    def target(self, nbfile) -> Path:
        path = Path(str(nbfile.fspath)).resolve()
        try:
            relative = path.relative_to(Path(self.config.rootpath).resolve())
        except ValueError:
            relative = Path(path.name)
        return self.folder / relative

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        from nbval.plugin import IPyNbCell

        for nbfile in {item.parent for item in items if isinstance(item, IPyNbCell)}:
            target = self.target(nbfile)
            target.unlink(missing_ok=True)  # an old copy must not outlive a new run
            self.notebooks[nbfile.nodeid] = ExecutedNotebook(nbfile.nb, target)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        from nbval.plugin import IPyNbCell

        if not isinstance(item, IPyNbCell):
            yield
            return
        nbfile = item.parent
        executed = self.notebooks.get(nbfile.nodeid)
        kernel = nbfile.kernel
        if "execute_cell_input" not in vars(kernel):  # the notebook's first cell
            if executed is not None:
                # as nbclient does: the kernel's language_info (pygments_lexer: ipython3)
                # chooses the website's syntax highlighting of the code cells
                info = kernel.kc.kernel_info(reply=True, timeout=60)["content"]
                if "language_info" in info:
                    executed.nb.metadata.language_info = info["language_info"]

            # nbval executes with store_history=False, Jupyter with True; IPython then looks
            # for a trailing `;` (no output) in an older cell and shows e.g. `[<Line2D ...>]`
            def execute_as_jupyter(cell_input, allow_stdin=None):
                return kernel.kc.execute(cell_input, store_history=True,
                                         allow_stdin=allow_stdin, stop_on_error=False)

            kernel.execute_cell_input = execute_as_jupyter
        messages: list[dict] = []
        if "get_kernel_message" not in vars(nbfile):  # record what nbval reads
            read = nbfile.get_kernel_message

            def recording(*args, **kwargs):
                msg = read(*args, **kwargs)
                nbfile._executed_messages.append(msg)
                return msg

            nbfile.get_kernel_message = recording
        nbfile._executed_messages = messages
        outcome = yield
        if executed is None:
            return
        index = next(i for i, c in enumerate(nbfile.nb.cells) if c is item.cell)
        if outcome.excinfo is None and messages:
            executed.add(index, messages)
        else:
            executed.failed = True

    def pytest_runtest_logreport(self, report):
        # a cell that fails in setup or teardown (e.g. the kernel does not start)
        executed = self.notebooks.get(report.nodeid.split("::")[0])
        if report.failed and executed is not None:
            executed.failed = True

    def pytest_sessionfinish(self, session):
        for executed in self.notebooks.values():
            if executed.complete():
                executed.write()


def pytest_configure(config):
    folder = config.getoption(OPTION)
    if folder:
        config.pluginmanager.register(Recorder(config, Path(folder).resolve()),
                                      "nbval-executed-recorder")
