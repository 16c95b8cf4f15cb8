"""A DataTable kept current in place: stable row keys, diffed cells, sort, regex filter.

Rows are never cleared and re-added (``clear()`` resets the cursor and flickers): a changed
value is one cell write; rows come and go with ``add_row``/``remove_row``; the cursor stays on
the same row key through sorts, filters and removals.

Cell writes: ``DataTable.update_cell`` bumps a counter that every render cache is keyed on, so
after any change the next frame re-renders every visible cell (about 0.2 ms each: ~150 ms a
frame at 160x48). With hundreds of fellows heartbeating every second that is all the CPU there
is. ``_write_cell`` stores the value like ``update_cell`` does and, before the next frame,
drops only the cached renders of the rows it touched, and repaints only those lines that are
on screen (Textual is pinned exactly, so these private caches are a known quantity;
``tests/unit/test_tui_table.py`` checks what is painted).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from rich.text import Text
from textual.binding import Binding
from textual.cache import LRUCache
from textual.coordinate import Coordinate
from textual.geometry import Region
from textual.strip import Strip
from textual.widgets import DataTable
from textual.widgets.data_table import CellDoesNotExist, ColumnKey, RowDoesNotExist, RowKey

from swarm_tui.app.cells import Cell, Column
from swarm_tui.app.export import SKIP_COLUMNS, cell_value
from swarm_tui.typed import clip

CellsFor = Callable[[str], dict[str, Cell]]
HaystackFor = Callable[[str], str]
_K = TypeVar("_K")


class LiveTable(DataTable[Cell]):
    DEFAULT_CSS = """
    LiveTable { height: 1fr; }
    """
    # vim's keys, and Home/End to the first and last row as help says (DataTable's own
    # Home/End scroll sideways: the frozen columns make that the right/left arrows' job).
    BINDINGS = [
        Binding("j", "cursor_down", "Down", show=False, id="table.down"),
        Binding("k", "cursor_up", "Up", show=False, id="table.up"),
        Binding("home,g", "scroll_top", "First row", show=False, id="table.first"),
        Binding("end,G", "scroll_bottom", "Last row", show=False, id="table.last"),
    ]

    def __init__(self, columns: Sequence[Column], cells_for: CellsFor, haystack_for: HaystackFor,
                 *, sort_column: str, sort_reverse: bool = False, id: str | None = None,
                 classes: str | None = None) -> None:
        super().__init__(cursor_type="row", zebra_stripes=False, id=id, classes=classes)
        self.spec = tuple(columns)
        self._fits = {c.key: c.fit for c in self.spec if c.fit is not None}
        self.cells_for = cells_for
        self.haystack_for = haystack_for
        self.sort_column = sort_column
        self.sort_reverse = sort_reverse
        self.filter_text = ""
        self._filter: re.Pattern[str] | None = None
        self._shown: dict[str, dict[str, tuple[str, str]]] = {}  # row key -> column -> signature
        self._dirty_rows: set[str] = set()  # rows whose cached renders are out of date
        self.updates = 0  # cells written (tests and the benchmark read it)
        # The columns on screen, with their widths: those that fit the table's width by
        # priority (a narrow terminal keeps the essential ones), or those the user chose.
        self.chosen: tuple[str, ...] | None = None
        self.col_widths: dict[str, int] = {}

    def on_mount(self) -> None:
        self._apply_layout(self.fit(self._width()))

    def on_resize(self) -> None:
        layout = self.fit(self._width())
        if layout != self.col_widths:
            self._apply_layout(layout)

    def _width(self) -> int:
        width = self.size.width or self.app.size.width
        return max(0, width - 1)  # (the vertical scrollbar)

    # columns ----------------------------------------------------------------------------------
    # This shadows textual's DOMNode.visible (a bool with a setter), so textual's own focus and
    # hit tests see a list here. Kept as is because tests read the columns under this name;
    # renaming it (visible_columns) is the fix, and changes what textual sees.
    @property  # type: ignore[misc]
    def visible(self) -> list[str]:  # type: ignore[override]
        return list(self.col_widths)

    def fit(self, width: int) -> dict[str, int]:
        """Column key -> width, in the spec's order: the chosen columns, else every column of
        priority 0 and then by priority while they fit (the sort column always); a stretching
        column takes what is left."""
        pad = 2 * self.cell_padding
        if self.chosen is not None:
            keep = [c for c in self.spec if c.key in self.chosen or c.key == self.sort_column]
            return {c.key: self._least(c) for c in keep}
        order = sorted(range(len(self.spec)), key=lambda i: (
            self.spec[i].priority if self.spec[i].key != self.sort_column else -1, i))
        used, keep_ix = 0, set()
        for i in order:
            col = self.spec[i]
            need = self._least(col) + pad
            if col.priority > 0 and col.key != self.sort_column and used + need > width:
                continue
            used += need
            keep_ix.add(i)
        out = {}
        for i, col in enumerate(self.spec):
            if i in keep_ix:
                out[col.key] = self._least(col) + (max(0, width - used) if col.stretch else 0)
        return out

    def _least(self, col: Column) -> int:
        """A column's width: the sort column's also holds its label and the arrow (``tx
        Mb/s▲`` is one wider than the column's numbers, and the arrow was cut off)."""
        if col.key != self.sort_column:
            return col.width
        return max(col.width, self._label(col).cell_len)

    def set_columns(self, columns: Sequence[Column]) -> None:
        """Another set of columns (a job with replicas has more); laid out again only when
        they differ. A choice of columns keeps those that still exist."""
        spec = tuple(columns)
        if spec == self.spec:
            return
        self.spec = spec
        self._fits = {c.key: c.fit for c in spec if c.fit is not None}
        if self.chosen is not None:
            self.chosen = tuple(k for k in self.chosen if any(c.key == k for c in spec))
        if self.is_mounted:
            self._apply_layout(self.fit(self._width()))

    def choose(self, columns: tuple[str, ...] | None) -> None:
        """Show these columns (None: by width again)."""
        self.chosen = columns
        self._apply_layout(self.fit(self._width()))

    def _apply_layout(self, layout: dict[str, int]) -> None:
        """Put these columns up; the rows are rebuilt in place (a resize or a choice is rare,
        and every row's cells change)."""
        keys = self.shown_keys
        cursor = self.cursor_key
        self.clear(columns=True)
        self._shown.clear()
        self.col_widths = dict(layout)
        by_key = {c.key: c for c in self.spec}
        for key, width in self.col_widths.items():
            self.add_column(self._label(by_key[key]), width=width, key=key)
        frozen = 0
        for key in self.col_widths:
            if not by_key[key].frozen:
                break
            frozen += 1
        self.fixed_columns = frozen
        if keys:
            self.update_rows(keys, check_filter=False, cursor=cursor, force_sort=True)

    # queries ----------------------------------------------------------------------------------
    @property
    def shown_keys(self) -> list[str]:
        """Row keys in display order."""
        return [row.key.value for row in self.ordered_rows if row.key.value is not None]

    @property
    def cursor_key(self) -> str | None:
        if not self.row_count:
            return None
        try:
            return self.coordinate_to_cell_key(Coordinate(self.cursor_row, 0)).row_key.value
        except CellDoesNotExist:
            return None

    def export_rows(self) -> tuple[list[str], list[dict[str, object]]]:
        """The view as data: column keys (every column, also those too wide for the screen),
        and one dict per shown row in display order."""
        spec = [c for c in self.spec if c.key not in SKIP_COLUMNS]
        rows = []
        for key in self.shown_keys:
            cells = self.cells_for(key)
            rows.append({c.export_name: _rounded(cell_value(cells.get(c.key)), c.digits)
                         for c in spec})
        return [c.export_name for c in spec], rows

    def matches(self, key: str) -> bool:
        return self._filter is None or self._filter.search(self.haystack_for(key)) is not None

    # filter and sort --------------------------------------------------------------------------
    def set_filter(self, text: str, keys: Iterable[str]) -> str | None:
        """Filter rows by a case-insensitive regex; returns an error (and changes nothing) if
        ``text`` is not one."""
        try:
            pattern = re.compile(text, re.IGNORECASE) if text else None
        except (re.error, OverflowError, RecursionError) as exc:
            # (The last two: a repeat count past the engine's limit, or nesting past Python's.)
            return f"not a regular expression: {clip(str(exc), 80)}"
        self.filter_text, self._filter = text, pattern
        self.rebuild(keys)
        return None

    def set_sort(self, column: str, reverse: bool | None = None) -> None:
        if reverse is None:
            reverse = not self.sort_reverse if column == self.sort_column else False
        self.sort_column, self.sort_reverse = column, reverse
        # (a column too wide for the screen shows now; the sort column holds its arrow)
        layout = self.fit(self._width())
        if layout != self.col_widths:
            self._apply_layout(layout)
        for col in self.spec:
            if col.key in self.col_widths:
                self.columns[ColumnKey(col.key)].label = self._label(col)
        self._resort()

    def _label(self, col: Column) -> Text:
        if col.key != self.sort_column:
            return Text(col.label)
        return Text(col.label.rstrip() + ("▼" if self.sort_reverse else "▲"), style="bold")

    def _resort(self, keep: str | bool | None = True) -> None:
        """Sort; the cursor stays on row ``keep`` (True: the row it is on now; None: the top)."""
        if not self.row_count:
            return
        key = self.cursor_key if keep is True else keep
        self.sort(self.sort_column, key=self._order)
        if key is None:
            self.move_cursor(row=0, animate=False)
        elif isinstance(key, str):  # (False: the cursor stays where the sort left it)
            self._restore_cursor(key)

    def _order(self, cell: Cell) -> tuple[object, ...]:
        """Where a cell sorts: by value, either way round, missing values last both ways."""
        missing, *rest = cell.sort_key
        return (missing, _Desc(tuple(rest)) if self.sort_reverse else tuple(rest))

    def _restore_cursor(self, key: str | None) -> None:
        if key is None or key not in self._shown:
            return
        try:
            index = self.get_row_index(key)
        except RowDoesNotExist:
            return
        if index != self.cursor_row:
            self.move_cursor(row=index, animate=False)

    # updates ----------------------------------------------------------------------------------
    def rebuild(self, keys: Iterable[str]) -> None:
        """Make the rows exactly ``keys`` (those that pass the filter)."""
        wanted = [k for k in keys if self.matches(k)]
        wanted_set = set(wanted)
        cursor = self.cursor_key
        removed = False
        for key in [k for k in self._shown if k not in wanted_set]:
            self.remove_row(key)
            del self._shown[key]
            removed = True
        self.update_rows(wanted, check_filter=False, cursor=cursor, force_sort=removed)

    def update_rows(self, keys: Iterable[str], *, check_filter: bool = True,
                    cursor: str | None = None, force_sort: bool = False) -> None:
        """Bring these rows up to date (adding or, when filtered out, removing them)."""
        if not self.col_widths:
            # Rows before the table's own mount (its screen's came first): columns first,
            # or the rows would have no cells to sort by.
            self._apply_layout(self.fit(self._width()))
        cursor = cursor if cursor is not None else self.cursor_key  # None: the table was empty
        resort = force_sort
        for key in keys:
            if check_filter and not self.matches(key):
                if key in self._shown:
                    self.remove_row(key)
                    del self._shown[key]
                continue
            cells = self.cells_for(key)
            shown = self._shown.get(key)
            widths = self.col_widths
            if shown is None:
                self.add_row(*(self._fitted(c, cells[c]) for c in widths), key=key)
                self._shown[key] = {c: cells[c].signature for c in widths}
                self.updates += len(widths)
                resort = True
                continue
            for col, cell in cells.items():
                if col not in widths:
                    continue
                sig = cell.signature
                if shown.get(col) != sig:
                    if col == self.sort_column and not self._still_in_order(key, cell):
                        resort = True
                    self._write_cell(key, col, cell)
                    shown[col] = sig
                    self.updates += 1
        if resort:
            self._resort(keep=cursor)
        else:
            self._restore_cursor(cursor)

    def update_column(self, column: str, cell_for: Callable[[str], Cell],
                      skip: Iterable[str] = ()) -> None:
        """Recompute one column of every shown row (ages, once a second)."""
        if column not in self.col_widths:
            return
        skipped = set(skip)
        resort = False
        for key, shown in self._shown.items():
            if key in skipped:
                continue
            cell = cell_for(key)
            sig = cell.signature
            if shown.get(column) != sig:
                if column == self.sort_column and not self._still_in_order(key, cell):
                    resort = True
                self._write_cell(key, column, cell)
                shown[column] = sig
                self.updates += 1
        if resort:
            self._resort()

    def _still_in_order(self, key: str, cell: Cell) -> bool:
        """Does the row keep its place with this new sort value? (Then no re-sort.)"""
        try:
            index = self.get_row_index(key)
        except RowDoesNotExist:
            return False
        col = ColumnKey(self.sort_column)
        mine = self._order(cell)
        for neighbour, before in ((index - 1, True), (index + 1, False)):
            if not 0 <= neighbour < self.row_count:
                continue
            other_key = self._row_locations.get_key(neighbour)
            if other_key is None:
                return False
            other = self._order(self._data[other_key][col])
            if (other > mine) if before else (mine > other):
                return False
        return True

    # cell writes that keep the render caches of the other rows ---------------------------------
    def _fitted(self, column: str, cell: Cell) -> Cell:
        """The cell as its column shows it: a name too long for it cut as the column says
        (the widths are those laid out; a new layout writes every row again)."""
        width = self.col_widths.get(column, 0)
        fit = self._fits.get(column)
        if fit is None or cell.cell_len <= width:
            return cell
        return cell.shown_as(fit(cell.plain, width))

    def _write_cell(self, key: str, column: str, cell: Cell) -> None:
        row_key = RowKey(key)
        if row_key not in self._row_locations:
            raise CellDoesNotExist(f"no row {key!r}")
        self._data[row_key][ColumnKey(column)] = self._fitted(column, cell)
        self._dirty_rows.add(key)
        index = self._row_locations.get(row_key)
        if index is not None:
            # Repaint that line, and only if it is on screen. (Not refresh_row: it adds up the
            # heights of every row above, which makes a once-a-second pass over N rows O(N²);
            # our rows are one line high.)
            header = self.header_height if self.show_header else 0
            self._refresh_region(Region(0, header + index, self.virtual_size.width, 1))

    def _drop_stale_renders(self) -> None:
        rows = self._dirty_rows
        if not rows:
            return
        self._dirty_rows = set()
        indexes = {self._row_locations.get(RowKey(k)) for k in rows} - {None}
        header = self.header_height if self.show_header else 0
        lines = {i + header for i in indexes if i is not None}  # rows are one line high
        # One call per cache: their keys differ in shape, so each gets its own test.
        _discard_where(self._cell_render_cache, lambda k: k[0] in rows)
        _discard_where(self._row_render_cache, lambda k: k[0] in rows)
        _discard_where(self._row_renderable_cache, lambda k: k[1] in indexes)
        _discard_where(self._line_cache, lambda k: k[0] in lines)

    def render_lines(self, crop: Region) -> list[Strip]:
        self._drop_stale_renders()
        return super().render_lines(crop)


def _discard_where(cache: LRUCache[_K, Any], stale: Callable[[_K], bool]) -> None:
    for cache_key in [k for k in cache.keys() if stale(k)]:  # noqa: SIM118
        cache.discard(cache_key)


def _rounded(value: object, digits: int | None) -> object:
    if digits is None or not isinstance(value, float):
        return value
    return round(value, digits)


class _Desc:
    """Reverses comparisons, so one ascending sort can order values descending."""

    __slots__ = ("value",)

    def __init__(self, value: tuple[object, ...]) -> None:
        self.value = value

    def __lt__(self, other: _Desc) -> bool:
        return other.value < self.value

    def __gt__(self, other: _Desc) -> bool:
        return other.value > self.value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Desc) and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)
