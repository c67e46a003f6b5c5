// Copies the dashboard's npm dependencies into static/vendor/ (committed), so the app
// runs without npm. Reproducible: `npm ci && npm run build` gives byte-identical files.
import { copyFileSync, mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const vendor = join(here, "..", "static", "vendor");

const copies = {
  uplot: ["dist/uPlot.esm.js", "dist/uPlot.min.css", "LICENSE"],
};

const manifest = {};
for (const [pkg, files] of Object.entries(copies)) {
  const src = join(here, "node_modules", pkg);
  const { version } = JSON.parse(readFileSync(join(src, "package.json"), "utf8"));
  const out = join(vendor, pkg);
  mkdirSync(out, { recursive: true });
  for (const f of files) {
    copyFileSync(join(src, f), join(out, f.split("/").pop()));
  }
  manifest[pkg] = { version, files: files.map((f) => f.split("/").pop()) };
}
writeFileSync(join(vendor, "manifest.json"), JSON.stringify(manifest, null, 2) + "\n");
console.log("vendored:", JSON.stringify(manifest));
