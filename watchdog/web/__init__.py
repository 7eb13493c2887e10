"""The bundle page: HTML rendering (``page``) and its two templates (page.html, style.css)."""
