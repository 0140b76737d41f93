"""The command palette (ctrl+p): every action of the registry that applies where it was opened."""

from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

from tui.actions import Action


class ActionCommands(Provider):
    """Offers the registry's actions for the screen the palette was opened on. The app says
    which apply there (`palette_actions`) and runs the chosen one (`run_palette_action`), the way
    Textual's own system commands come from `App.get_system_commands`."""

    def _actions(self) -> list[Action]:
        return self.app.palette_actions(self.screen)

    def _run(self, action: Action) -> None:
        self.app.run_palette_action(action, self.screen)

    async def discover(self) -> Hits:
        for action in self._actions():
            yield DiscoveryHit(action.palette_title, partial(self._run, action),
                               help=action.palette_help)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for action in self._actions():
            score = matcher.match(action.palette_title)
            if score > 0:
                yield Hit(score, matcher.highlight(action.palette_title),
                          partial(self._run, action), help=action.palette_help)
