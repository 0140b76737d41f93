"""The one wrapper around Textual's DataTable: rows keyed by id, diff-updated in place, marks,
cursor kept on its row, and the private render caches the fast path relies on."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from rich.text import Text
from textual import on
from textual.geometry import Size
from textual.message import Message
from textual.widgets import DataTable
from textual.widgets.data_table import CellDoesNotExist, CellKey, ColumnKey, RowDoesNotExist, RowKey

from tui import actions

MARK = Text("●", style="bold magenta")
NO_MARK = Text(" ")
# A sync where most rows are gone (a filter changed) rebuilds the table and starts at its top;
# fewer are removed in place, the view staying where it was.
REBUILD_AFTER = 64


def _same(cells: Any) -> Any:
    return cells


def _plain(value: Any) -> Any:
    """Strings from the daemon (job names, labels, reasons) are data, never Rich markup."""
    return Text(value) if isinstance(value, str) else value


class KeyedTable(DataTable):
    """Rows keyed by the value of their first column; a mark column in front for Space.

    Callers see string keys only: Enter posts `RowChosen`, marking posts `MarksChanged`."""

    BINDINGS = actions.bindings("table")

    class RowChosen(Message):
        """Enter on a row: `key` is the row's id (a node name, a job id as text, ...)."""

        def __init__(self, table: KeyedTable, key: str) -> None:
            super().__init__()
            self.table = table
            self.key = key

        @property
        def control(self) -> KeyedTable:
            return self.table

    class MarksChanged(Message):
        """Rows were marked or unmarked by a key."""

        def __init__(self, table: KeyedTable) -> None:
            super().__init__()
            self.table = table

        @property
        def control(self) -> KeyedTable:
            return self.table

    def __init__(self, columns: Iterable[tuple[str, int]], **kwargs: Any) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self._spec = list(columns)
        self.marks: set[str] = set()
        self._cells: dict[str, tuple] = {}
        self._order: list[str] = []
        self._pending: dict[str, Any] = {}
        self._make: Callable[[Any], tuple] = _same

    def on_mount(self) -> None:
        # The visible cells in a few styles (cursor, zebra) fit in 3,000 entries; a smaller cache
        # than DataTable's 10,000 keeps _forget_renders' scan short.
        cache = getattr(self, "_cell_render_cache", None)
        if cache is not None and hasattr(cache, "maxsize"):
            cache.maxsize = 3000
        self.add_column(" ", width=1, key="_mark")
        for label, width in self._spec:
            self.add_column(label, width=width, key=label)
        self._column_keys = [ColumnKey(label) for label, _ in self._spec]

    @property
    def keys(self) -> list[str]:
        """Row keys in display order."""
        return list(self._order)

    @property
    def cursor_key(self) -> str | None:
        if not self.row_count:
            return None
        try:
            return self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value
        except CellDoesNotExist:
            return None

    def selected(self) -> list[str]:
        """The marked rows in display order, else the row under the cursor."""
        if self.marks:
            return [k for k in self._order if k in self.marks]
        key = self.cursor_key
        return [key] if key is not None else []

    def sync(self, items: dict[str, Any], make_cells: Callable[[Any], tuple] | None = None) -> None:
        """Make the table show `items` (key -> item, in display order), touching only what changed.

        With `make_cells`, items are raw (a node, a job) and cells are computed only for rows on
        screen (plus a margin); rows off screen keep their item pending until scrolled to. At
        1,000 nodes that turns a refresh tick from O(rows) into O(visible rows)."""
        make = make_cells or _same
        cursor = self.cursor_key
        with self.app.batch_update():
            gone = [k for k in self._cells if k not in items]
            self._pending = {}
            if len(gone) > REBUILD_AFTER and 2 * len(gone) > len(self._cells):
                self._rebuild({k: make(v) for k, v in items.items()})
            else:
                self._remove_rows(gone)
                for key in gone:
                    del self._cells[key]
                added = False
                changed: set[tuple[str, str]] = set()
                lo, hi = self._window()
                for key, item in items.items():
                    if key not in self._cells:
                        cells = make(item)
                        self.add_row(self._mark(key), *map(_plain, cells), key=key)
                        self._cells[key] = cells
                        added = True
                    elif make_cells is None or lo <= self.get_row_index(key) <= hi:
                        self._write(key, make(item), changed)
                    else:
                        self._pending[key] = item
                if added or gone:
                    self._reorder(list(items))
                self._make = make
                self._flush_pending(changed)
                if changed:
                    self._forget_renders(changed)
                    self.refresh()
            self._order = list(items)
            self.marks &= set(items)
            if cursor is not None and cursor in items:
                self._move_to(cursor)

    def _write(self, key: str, cells: tuple, changed: set[tuple[str, str]]) -> None:
        """Write the cells of one row that differ from what it shows (what update_cell does,
        without its refresh per cell: widths are fixed, so nothing needs a relayout)."""
        old = self._cells[key]
        if old == cells:
            return
        data = self._data[RowKey(key)]
        for column, a, b in zip(self._column_keys, old, cells, strict=False):
            if a != b:
                data[column] = _plain(b)
                changed.add((key, column.value))
        self._cells[key] = cells

    def _window(self) -> tuple[int, int]:
        """Row indices on screen, with a screen's worth of margin either side."""
        height = max(self.size.height, 10)
        top = int(self.scroll_y)
        return top - height, top + 2 * height

    def _flush_pending(self, changed: set[tuple[str, str]] | None = None) -> None:
        """Compute and write pending rows that are (now) on screen."""
        if not self._pending:
            return
        own = changed is None
        changed = set() if own else changed
        lo, hi = self._window()
        for key in [k for k in self._pending if lo <= self.get_row_index(k) <= hi]:
            self._write(key, self._make(self._pending.pop(key)), changed)
        if own and changed:
            self._forget_renders(changed)
            self.refresh()

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        self._flush_pending()

    def _forget_renders(self, cells: set[tuple[str, str]]) -> None:
        """Forget the rendering of the changed cells only. (Bumping `_update_count`, as
        update_cell does, re-renders every visible cell; at 1,000 nodes the changed ones are
        a third of them.) Falls back to the bump if DataTable's caches are not as expected."""
        try:
            cell_cache = self._cell_render_cache
            stale = [k for k in cell_cache.keys() if (k[0], k[1]) in cells]  # noqa: SIM118 (not iterable)
            for cache_key in stale:
                cell_cache.discard(cache_key)
            self._row_renderable_cache.clear()
            self._row_render_cache.clear()
            self._line_cache.clear()
        except (AttributeError, TypeError, IndexError):
            self._update_count += 1

    def _remove_rows(self, keys: list[str]) -> None:
        """Remove these rows in one pass. DataTable's remove_row renumbers every row after the
        one it removes: on a busy cluster's jobs view (2,000 rows, a few dozen jobs ending
        between two refreshes) that was 13 ms a row, most of the TUI's work on the refresh.
        What remove_row does is done here once for them all; should DataTable's insides not be
        as expected, its remove_row does it row by row."""
        if not keys:
            return
        try:
            locations = self._row_locations
            gone = {RowKey(k) for k in keys}
            order = sorted((i, k) for k, i in ((k, locations.get(k)) for k in locations) if k not in gone)
            for key in gone:
                for column in self._data[key]:
                    self._updated_cells.discard(CellKey(key, column))
            renumbered = type(locations)({k: n for n, (_, k) in enumerate(order)})
        except (AttributeError, TypeError, KeyError):
            for key in keys:
                self.remove_row(key)
            return
        self._require_update_dimensions = True
        self.check_idle()
        self._row_locations = renumbered
        for key in gone:
            del self.rows[key]
            del self._data[key]
        self.cursor_coordinate = self.cursor_coordinate  # clamped, as remove_row does
        self.hover_coordinate = self.hover_coordinate
        self._update_count += 1
        self.refresh(layout=True)

    def _update_dimensions(self, new_rows: Iterable[RowKey]) -> None:
        """The table's scrollable size after rows came. DataTable's own measures every cell of
        every new row for the columns that size to their content, and looks the console's size
        up for each: at a rebuild of the 2,000-job page, about a second of the TUI's CPU, the
        largest part of its work on a busy cluster (tests/bench/bench_tui_busy.py). Here every
        column has a fixed width and every row one line, so nothing needs measuring; should
        that change (a column sized to its content, a row of several lines), DataTable's runs."""
        if any(c.auto_width for c in self.columns.values()) or any(
                self.rows[k].auto_height or self.rows[k].label is not None for k in new_rows if k in self.rows):
            super()._update_dimensions(new_rows)
            return
        width = sum(c.get_render_width(self) for c in self.columns.values()) + self._row_label_column_width
        self.virtual_size = Size(width, self._total_row_height + (self.header_height if self.show_header else 0))

    def _rebuild(self, rows: dict[str, tuple]) -> None:
        self.clear()
        self._cells = {}
        for key, cells in rows.items():
            self.add_row(self._mark(key), *map(_plain, cells), key=key)
            self._cells[key] = cells

    def _reorder(self, order: list[str]) -> None:
        if list(self._iter_keys()) == order:
            return
        position = {k: i for i, k in enumerate(order)}
        first = self._spec[0][0]
        self.sort(first, key=lambda v: position.get(str(v), len(position)))

    def _iter_keys(self) -> Iterable[str]:
        for row in self.ordered_rows:
            yield row.key.value

    def _move_to(self, key: str) -> None:
        try:
            index = self.get_row_index(key)
        except RowDoesNotExist:
            return
        if index != self.cursor_row:
            self.move_cursor(row=index, scroll=False)

    def _mark(self, key: str) -> Text:
        return MARK if key in self.marks else NO_MARK

    def toggle_mark(self, key: str | None = None) -> None:
        key = key if key is not None else self.cursor_key
        if key is None:
            return
        self.marks ^= {key}
        self.update_cell(key, "_mark", self._mark(key))

    def mark_all(self) -> None:
        """Mark every visible row; if all are marked already, unmark them."""
        target = set() if self.marks >= set(self._order) and self._order else set(self._order)
        changed = self.marks ^ target
        self.marks = target
        with self.app.batch_update():
            for key in changed:
                self.update_cell(key, "_mark", self._mark(key))

    def clear_marks(self) -> None:
        changed, self.marks = self.marks, set()
        for key in changed:
            self.update_cell(key, "_mark", NO_MARK)

    def action_mark(self) -> None:
        self.toggle_mark()
        self.post_message(self.MarksChanged(self))

    def action_mark_all(self) -> None:
        self.mark_all()
        self.post_message(self.MarksChanged(self))

    @on(DataTable.RowSelected)
    def _chosen(self, event: DataTable.RowSelected) -> None:
        event.stop()
        self.post_message(self.RowChosen(self, event.row_key.value))
