"""Draw docs/owner-exchange.svg: one Muon matrix's trip shard -> owner -> shard at W = 4.

    python scripts/make_diagram.py            # rewrites docs/owner-exchange.svg

Plain SVG text, no plotting dependency. The figure: each of 4 ranks holds one ZeRO-3 chunk of the
matrix's momentum-based update (the last chunk padded); all_to_all #1 brings the 4 chunks to the
owner (rank 2), which strips the padding, runs Newton–Schulz on the whole matrix and cuts the result
into chunks; all_to_all #2 returns chunk r to rank r, which applies it to its fp32 shard.
"""
from __future__ import annotations

from pathlib import Path

W, OWNER = 4, 2
COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759"]
OUT = Path(__file__).resolve().parent.parent / "docs" / "owner-exchange.svg"


def rect(x, y, w, h, fill, text="", stroke="#333", dash=False):
    d = ' stroke-dasharray="4 3"' if dash else ""
    label = (f'<text x="{x + w / 2}" y="{y + h / 2 + 4}" text-anchor="middle" font-size="12" '
             f'font-family="sans-serif" fill="#fff">{text}</text>') if text else ""
    return f'<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="{fill}" stroke="{stroke}"{d}/>{label}'


def text(x, y, s, size=13, anchor="middle", weight="normal"):
    return (f'<text x="{x}" y="{y}" text-anchor="{anchor}" font-size="{size}" font-weight="{weight}" '
            f'font-family="sans-serif">{s}</text>')


def arrow(x1, y1, x2, y2, color="#555"):
    return (f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{color}" stroke-width="1.5" '
            f'marker-end="url(#a)"/>')


def main() -> None:
    parts = ['<svg xmlns="http://www.w3.org/2000/svg" width="900" height="330" viewBox="0 0 900 330">',
             '<defs><marker id="a" markerWidth="8" markerHeight="8" refX="7" refY="4" orient="auto">'
             '<path d="M0,0 L8,4 L0,8 z" fill="#555"/></marker></defs>',
             '<rect width="900" height="330" fill="#fff"/>',
             text(450, 22, "One Muon matrix at W = 4 (owner: rank 2)", 15, weight="bold")]
    cols = {"shard": 20, "owner": 330, "back": 650}
    parts += [text(cols["shard"] + 90, 48, "1. local shards: m, u (fp32)"),
              text(cols["owner"] + 100, 48, "2. owner: full matrix, NS"),
              text(cols["back"] + 90, 48, "3. shards: p -= lr*o")]
    for r in range(W):
        y = 70 + r * 60
        parts.append(text(cols["shard"] - 2, y + 20, f"rank {r}", 12, anchor="start"))
        parts.append(rect(cols["shard"] + 50, y, 120, 30, COLORS[r], f"chunk {r}" + (" + pad" if r == W - 1 else ""),
                          dash=r == W - 1))
        parts.append(rect(cols["back"] + 50, y, 120, 30, COLORS[r], f"o chunk {r}"))
        parts.append(text(cols["back"] + 176, y + 20, f"rank {r}", 12, anchor="start"))
        if r != OWNER:
            parts.append(arrow(cols["shard"] + 172, y + 15, cols["owner"] - 5, 110 + r * 25))
            parts.append(arrow(cols["owner"] + 205, 110 + r * 25, cols["back"] + 48, y + 15))
    for r in range(W):
        parts.append(rect(cols["owner"], 100 + r * 25, 200, 22, COLORS[r],
                          f"chunk {r} (from rank {r})" if r != OWNER else f"chunk {r} (owner's own)"))
    parts.append(text(cols["owner"] + 100, 220, "strip padding, view(m, n)", 12))
    parts.append(text(cols["owner"] + 100, 238, "O = NS(U) * scale (batched by shape)", 12))
    parts.append(text(cols["owner"] + 100, 256, "cut O into W chunks", 12))
    parts.append(text(450, 300, "all_to_all #1 (chunks to owners) ... all_to_all #2 (results back); momentum never moves; "
                      "bf16 on the wire by default", 12))
    parts.append("</svg>")
    OUT.write_text("\n".join(parts) + "\n", encoding="utf-8")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
