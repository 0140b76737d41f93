"""The TUI's table skips DataTable's per-cell measuring (its columns have fixed widths): what it
shows and how far it scrolls must stay exactly what DataTable's own sizing gives, through the
adds, removals and rebuilds of a busy cluster's refreshes."""

from __future__ import annotations

import asyncio

from rich.text import Text
from textual.app import App, ComposeResult
from textual.widgets import DataTable

from tui.components.table import KeyedTable

COLUMNS = [("ID", 7), ("NAME", 16), ("STATE", 10)]


class Tables(App):
    def compose(self) -> ComposeResult:
        yield KeyedTable(COLUMNS, id="keyed")
        yield DataTable(id="stock")

    def on_mount(self) -> None:
        stock = self.query_one("#stock", DataTable)
        stock.add_column(" ", width=1, key="_mark")
        for label, width in COLUMNS:
            stock.add_column(label, width=width, key=label)


def jobs(ids) -> dict[str, tuple]:
    # names longer than their column, and wide characters: what a measuring pass would look at
    return {str(i): (str(i), f"train-{'ü' * (i % 30)}-漢字-{i}", "RUNNING" if i % 3 else "PENDING") for i in ids}


def test_the_table_sizes_and_scrolls_as_datatable_would_through_adds_removals_and_rebuilds():
    steps = [range(1, 300), range(1, 320), range(40, 330),  # a few gone: removed in place
             range(200, 2200),  # most gone: rebuilt
             range(2100, 2150), range(0)]

    async def run() -> None:
        app = Tables()
        async with app.run_test(size=(80, 24)) as pilot:
            keyed, stock = app.query_one("#keyed", KeyedTable), app.query_one("#stock", DataTable)
            for ids in steps:
                items = jobs(ids)
                keyed.sync(items)
                stock.clear()
                for key, cells in items.items():
                    stock.add_row(Text(" "), *map(Text, cells), key=key)
                await pilot.pause()
                assert keyed.virtual_size == stock.virtual_size, f"after {ids}"
                assert keyed.row_count == len(items)
                # the rows, in order, with their cells: what DataTable shows after the same rows
                assert [r.key.value for r in keyed.ordered_rows] == list(items)
                assert [[str(c) for c in keyed.get_row_at(i)[1:]] for i in range(keyed.row_count)] == \
                    [[str(c) for c in stock.get_row_at(i)[1:]] for i in range(stock.row_count)]
                if items:  # the end of the table scrolls into view, and its last row is the last job
                    keyed.move_cursor(row=keyed.row_count - 1)
                    await pilot.pause()
                    last = list(items)[-1]
                    assert keyed.cursor_key == last
                    assert keyed.scroll_y == keyed.max_scroll_y > 0 or keyed.row_count < 20
                    assert str(keyed.get_row(last)[1]) == items[last][0]

    asyncio.run(run())


def test_jobs_that_end_between_refreshes_leave_the_view_where_it_was():
    async def run() -> None:
        app = Tables()
        async with app.run_test(size=(80, 24)) as pilot:
            keyed = app.query_one("#keyed", KeyedTable)
            keyed.sync(jobs(range(1, 2001)))
            await pilot.pause()
            keyed.move_cursor(row=1009)
            await pilot.pause()
            y, cursor = keyed.scroll_y, keyed.cursor_key
            assert y > 900 and cursor == "1010"
            # 80 jobs ended, most above the view, and 30 came: more than REBUILD_AFTER, far from most
            ended = set(range(1, 2001, 25))
            keyed.sync(jobs([i for i in range(1, 2031) if i not in ended]))
            await pilot.pause()
            assert keyed.cursor_key == cursor  # the cursor stays on its job
            assert abs(keyed.scroll_y - y) <= len(ended)  # and the view near it, not at the top
            assert keyed.row_count == 2030 - len(ended)
            assert keyed.get_row_index("1010") == 1009 - sum(1 for i in ended if i < 1010)

    asyncio.run(run())
