"""A radix trie over token sequences: which stored states share how long a prefix
with a request. Edges hold runs of tokens, so a lookup costs one pass over the
request however many states are stored."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Node:
    edge: tuple[int, ...] = ()  # tokens on the edge into this node
    children: dict[int, "_Node"] = field(default_factory=dict)
    keys: set[str] = field(default_factory=set)  # states whose tokens end exactly here


def _common(a: tuple[int, ...], b, start: int) -> int:
    """Length of the common prefix of `a` and `b[start:]`."""
    n = min(len(a), len(b) - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class PrefixTrie:
    """Stored states' token sequences by key, in a radix trie: which share how long a prefix with a request."""

    def __init__(self) -> None:
        self._root = _Node()
        self._tokens: dict[str, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._tokens)

    def __contains__(self, key: str) -> bool:
        return key in self._tokens

    def tokens(self, key: str) -> tuple[int, ...]:
        """The token sequence stored under `key`."""
        return self._tokens[key]

    def insert(self, key: str, tokens) -> None:
        """Store `tokens` under `key`, replacing what `key` held."""
        tokens = tuple(int(t) for t in tokens)
        if key in self._tokens:
            self.remove(key)
        node, depth = self._root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                child = node.children[tokens[depth]] = _Node(tokens[depth:])
                node, depth = child, len(tokens)
                break
            n = _common(child.edge, tokens, depth)
            if n < len(child.edge):  # split the edge where the sequences part
                mid = _Node(child.edge[:n], {child.edge[n]: child})
                child.edge = child.edge[n:]
                node.children[tokens[depth]] = mid
                child = mid
            node, depth = child, depth + n
        node.keys.add(key)
        self._tokens[key] = tokens

    def remove(self, key: str) -> None:
        """Drop `key`, pruning the nodes it leaves empty and merging pass-through ones."""
        tokens = self._tokens.pop(key)
        path, node, depth = [], self._root, 0
        while depth < len(tokens):
            path.append(node)
            node = node.children[tokens[depth]]
            depth += len(node.edge)
        node.keys.discard(key)
        # prune empty leaves and merge single-child pass-through nodes
        while path and not node.keys and len(node.children) <= 1:
            parent = path.pop()
            first = node.edge[0]
            if node.children:
                (only,) = node.children.values()
                only.edge = node.edge + only.edge
                parent.children[first] = only
            else:
                del parent.children[first]
            node = parent

    def match(self, tokens) -> list[tuple[int, str]]:
        """(shared prefix length, key) for stored states sharing a non-empty prefix
        with `tokens`, longest first: every state that ends inside `tokens` (reusable
        as is) and every state that parts from `tokens` where the lookup stops
        (reusable once trimmed back to the shared part)."""
        tokens = tuple(tokens)
        found: list[tuple[int, str]] = []
        node, depth = self._root, 0
        while True:
            if depth:
                found.extend((depth, k) for k in node.keys)
            child = node.children.get(tokens[depth]) if depth < len(tokens) else None
            if child is None:  # parted here: states below share `depth` tokens
                if depth:
                    found.extend((depth, k) for c in node.children.values() for k in _keys_below(c))
                break
            n = _common(child.edge, tokens, depth)
            if n < len(child.edge):  # parted inside this edge
                found.extend((depth + n, k) for k in _keys_below(child))
                break
            node, depth = child, depth + n
        return sorted(found, key=lambda f: -f[0])


def _keys_below(node: _Node):
    stack = [node]
    while stack:
        n = stack.pop()
        yield from n.keys
        stack.extend(n.children.values())
