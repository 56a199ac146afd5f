"""Operations shared by the CLI, the JSON API and the pages (the console), and the console's two faces."""
