"""`interact` for the lessons: the same widgets as ipywidgets', and notebooks that also execute headless.

Use it exactly like ipywidgets' (same arguments, same decorator forms):

    from parlab.views.widgets import interact, interact_manual
    interact(draw, split=Dropdown(options=SPLITS), ranks=IntSlider(4, 1, 8));

Why not ipywidgets' own: its `interact` shows the function's output by letting the *front end* capture it. The
kernel tells the front end "outputs of this message go into Output widget W"; the front end writes them there and
sends W's new state back to the kernel. nbclient (behind `jupyter nbconvert --execute`, `jupyter execute`,
papermill) imitates that front end: for each output it captures, its IOPub reader task sends a `comm_msg` on the
shell socket, while its reply task awaits the cell's `execute_reply` on that same zmq.asyncio socket
(`await socket.poll(timeout)`). jupyter_client sends through a plain synchronous shadow of that socket, so pyzmq's
asyncio layer never learns of the send; but a send makes libzmq process the socket's pending commands, which
consumes the edge-triggered ZMQ_FD signal. If the reply has just arrived, its wake-up is lost: the reply sits unread
until the poll's timeout, where a last poll(0) finds it. So the cell takes exactly `--ExecutePreprocessor.timeout`
seconds, or forever without one (jupyter/nbclient#312, jupyter/nbconvert#2029). The more outputs the function shows
(a progress bar, prints, a figure), the more sends, the likelier a stall.

Here the kernel captures the function's output itself (stdout, stderr, displays, errors, in order) and sets the
Output widget's `outputs`: the front end only receives state and never sends any back, so there is nothing to race.
In JupyterLab it looks and behaves the same; a long run shows its output as it goes (at most every 0.5 s).
"""

from __future__ import annotations

import io
import sys
import time
import traceback

import ipywidgets
from IPython import get_ipython
from IPython.core.displaypub import DisplayPublisher
from ipywidgets.widgets.interaction import show_inline_matplotlib_plots

__all__ = ["Interactive", "interact", "interact_manual", "captured_outputs"]


class _Recorder:
    """Outputs in the order they were made, as nbformat output dicts (what an Output widget's `outputs` holds)."""

    def __init__(self, on_change=None) -> None:
        self.outputs: list[dict] = []
        self.by_display_id: dict[str, dict] = {}
        self.on_change = on_change or (lambda: None)

    def stream(self, name: str, text: str) -> None:
        last = self.outputs[-1] if self.outputs else None
        if last is not None and last["output_type"] == "stream" and last["name"] == name:
            last["text"] += text
        else:
            self.outputs.append({"output_type": "stream", "name": name, "text": text})
        self.on_change()

    def display(self, data: dict, metadata: dict | None, transient: dict | None, update: bool) -> None:
        display_id = (transient or {}).get("display_id")
        if update:  # update_display: the output shown under that id changes in place (e.g. a progress bar)
            shown = self.by_display_id.get(display_id)
            if shown is not None:
                shown["data"], shown["metadata"] = dict(data), dict(metadata or {})
                self.on_change()
            return
        output = {"output_type": "display_data", "data": dict(data), "metadata": dict(metadata or {})}
        self.outputs.append(output)
        if display_id:
            self.by_display_id[display_id] = output
        self.on_change()

    def error(self) -> None:
        etype, value, tb = sys.exc_info()
        shell = get_ipython()
        try:  # the coloured traceback a cell shows
            lines = shell.InteractiveTB.structured_traceback(etype, value, tb)
        except Exception:
            lines = traceback.format_exception(etype, value, tb)
        self.outputs.append(
            {"output_type": "error", "ename": etype.__name__, "evalue": str(value), "traceback": list(lines)}
        )

    def clear(self) -> None:
        self.outputs.clear()
        self.by_display_id.clear()


class _Stream(io.TextIOBase):
    def __init__(self, recorder: _Recorder, name: str) -> None:
        self.recorder, self.name = recorder, name

    def write(self, text: str) -> int:
        self.recorder.stream(self.name, text)
        return len(text)

    def writable(self) -> bool:
        return True


class _Publisher(DisplayPublisher):
    """Takes the place of the kernel's display publisher while a function's output is captured."""

    def __init__(self, recorder: _Recorder, shell) -> None:
        super().__init__(shell=shell)
        self._recorder = recorder

    def publish(self, data, metadata=None, source=None, *, transient=None, update=False):
        self._recorder.display(data, metadata, transient, update)

    def clear_output(self, wait=False):
        self._recorder.clear()


class captured_outputs:
    """`with captured_outputs() as outputs:` collects what the block prints and displays, in order.

    `outputs` is a list of nbformat output dicts: streams, display_data (updates by display_id applied in place),
    and an error output if the block raised (the exception does not propagate).
    """

    def __init__(self, on_change=None) -> None:
        self.on_change = on_change  # called after each new or changed output

    def __enter__(self) -> list[dict]:
        self.recorder = _Recorder(self.on_change)
        self.shell = get_ipython()
        self.saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Stream(self.recorder, "stdout"), _Stream(self.recorder, "stderr")
        if self.shell is not None:
            self.saved_publisher = self.shell.display_pub
            self.shell.display_pub = _Publisher(self.recorder, self.shell)
        return self.recorder.outputs

    def __exit__(self, etype, value, tb) -> bool:
        sys.stdout, sys.stderr = self.saved
        if self.shell is not None:
            self.shell.display_pub = self.saved_publisher
        if etype is not None and issubclass(etype, Exception):
            self.recorder.error()
            return True
        return False


class Interactive(ipywidgets.interactive):
    """ipywidgets.interactive whose function output is captured by the kernel, not by the front end."""

    LIVE_EVERY = 0.5  # s between two live updates of the output while the function runs

    def update(self, *args) -> None:
        self.kwargs = {}
        if self.manual:
            self.manual_button.disabled = True
        previous = () if self.clear_output else tuple(self.out.outputs)
        outputs: list[dict] = []
        last_push = time.monotonic()

        def push() -> None:  # state goes kernel -> front end only; nothing comes back
            self.out.outputs = previous + tuple({**o} for o in outputs)

        def live() -> None:  # a long run (a launch with its progress bar) shows its output as it goes
            nonlocal last_push
            if time.monotonic() - last_push >= self.LIVE_EVERY:
                last_push = time.monotonic()
                push()

        try:
            show_inline_matplotlib_plots()
            with captured_outputs(on_change=live) as outputs:
                for widget in self.kwargs_widgets:
                    self.kwargs[widget._kwarg] = widget.get_interact_value()
                self.result = self.f(**self.kwargs)
                show_inline_matplotlib_plots()
                if self.auto_display and self.result is not None:
                    self.shell_display(self.result)
            push()
        finally:
            if self.manual:
                self.manual_button.disabled = False

    @staticmethod
    def shell_display(value) -> None:
        from IPython.display import display

        display(value)


interact = Interactive.factory()
interact_manual = interact.options(manual=True, manual_name="Run Interact")
