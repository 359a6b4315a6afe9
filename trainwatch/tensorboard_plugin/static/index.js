// The trainwatch tab: what went wrong, where and when, at a glance.
//
// One ES module, no dependencies: TensorBoard loads it in an iframe whose
// content policy allows only this origin's scripts. It reads the plugin's
// JSON routes (./runs, ./alerts, ./norms) and redraws every 30 s, as
// TensorBoard's own reload does, and on the Reload button.

const SEVERITIES = ['error', 'warning', 'info'];
const COLORS = {error: '#c62828', warning: '#ef8f00', info: '#1e88e5'};
const SPECIAL = {nan: '#d500f9', inf: '#ff1744', zero: '#263238', missing: '#eceff1'};
const MAX_COLUMNS = 240;
const RELOAD_MS = 30000;
const SVG = 'http://www.w3.org/2000/svg';

const STYLE = `
  body { font-family: Roboto, Arial, sans-serif; font-size: 13px; color: #212121; margin: 16px; }
  h2 { font-size: 15px; margin: 20px 0 8px; }
  .controls { display: flex; gap: 16px; align-items: center; flex-wrap: wrap; }
  .controls label { display: inline-flex; gap: 4px; align-items: center; }
  .status { color: #757575; }
  table.alerts { border-collapse: collapse; width: 100%; margin-top: 8px; }
  table.alerts th, table.alerts td { border-bottom: 1px solid #e0e0e0; padding: 4px 6px;
    text-align: left; vertical-align: top; }
  table.alerts th { background: #fafafa; position: sticky; top: 0; }
  td.sev { font-weight: bold; text-transform: uppercase; }
  td.hint { color: #616161; }
  td.num { text-align: right; font-variant-numeric: tabular-nums; }
  .legend { display: flex; gap: 12px; align-items: center; margin: 4px 0; }
  .swatch { display: inline-block; width: 12px; height: 12px; margin-right: 4px;
    vertical-align: middle; border: 1px solid #bdbdbd; }
  .empty { color: #757575; font-style: italic; }
  svg text { font-size: 11px; fill: #424242; }
`;

const state = {
  runs: [], run: '', severities: new Set(SEVERITIES), everyStep: false, alerts: null, norms: {},
};
const ui = {};

async function getJson(path) {
  const response = await fetch(path);
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === 'class') node.className = value;
    else if (key.startsWith('on')) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  return node;
}

function moduleLabel(module) {
  if (module === null || module === undefined) return '';
  return module === '' ? '<model>' : module;
}

// -- data ---------------------------------------------------------------------

async function load() {
  ui.status.textContent = 'loading…';
  try {
    state.runs = (await getJson('./runs')).runs;
    const query = state.run ? `?run=${encodeURIComponent(state.run)}` : '';
    state.alerts = await getJson(`./alerts${query}`);
    const shown = state.run ? [state.run] : state.runs;
    const norms = await Promise.all(
        shown.map((run) => getJson(`./norms?run=${encodeURIComponent(run)}`)));
    state.norms = Object.fromEntries(norms.map((n) => [n.run, n]));
    ui.status.textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (error) {
    ui.status.textContent = `could not load: ${error.message}`;
  }
  draw();
}

function visibleAlerts() {
  if (!state.alerts) return [];
  return state.alerts.alerts.filter((a) =>
    state.severities.has(a.severity) && (!state.run || a.run === state.run));
}

// -- drawing ------------------------------------------------------------------

function draw() {
  drawRunSelector();
  const alerts = visibleAlerts();
  ui.count.textContent = `${alerts.length} alert${alerts.length === 1 ? '' : 's'}`;
  ui.timeline.replaceChildren(timeline(alerts));
  ui.table.replaceChildren(alertTable(alerts));
  const runs = state.run ? [state.run] : state.runs;
  ui.heatmaps.replaceChildren(...runs.map((run) => heatmapSection(run)));
}

function drawRunSelector() {
  const select = ui.runSelect;
  const options = [el('option', {value: ''}, 'all runs'),
    ...state.runs.map((run) => el('option', {value: run}, run || '.'))];
  select.replaceChildren(...options);
  select.value = state.runs.includes(state.run) ? state.run : '';
}

function timeline(alerts) {
  if (!alerts.length) return el('div', {class: 'empty'}, 'no alerts');
  const width = 900; const lane = 18; const left = 70; const height = lane * 3 + 24;
  const steps = alerts.map((a) => a.step);
  const lo = Math.min(...steps); const hi = Math.max(...steps, lo + 1);
  const x = (step) => left + (width - left - 10) * (step - lo) / (hi - lo);
  const chart = svg('svg', {width, height, class: 'timeline', role: 'img'});
  SEVERITIES.forEach((severity, i) => {
    const label = svg('text', {x: 4, y: 14 + i * lane});
    label.textContent = severity;
    chart.append(label);
  });
  for (const alert of alerts) {
    const row = SEVERITIES.indexOf(alert.severity);
    const dot = svg('circle', {
      cx: x(alert.step), cy: 10 + row * lane, r: alert.count > 1 ? 3 : 5,
      fill: COLORS[alert.severity] || '#9e9e9e', 'data-step': alert.step,
      'data-rule': alert.rule,
    });
    const tip = svg('title');
    tip.textContent = `step ${alert.step} ${alert.rule} ${moduleLabel(alert.module)}`;
    dot.append(tip);
    chart.append(dot);
  }
  for (const [step, anchor] of [[lo, 'start'], [hi, 'end']]) {
    const tick = svg('text', {x: x(step), y: height - 4, 'text-anchor': anchor});
    tick.textContent = `step ${step}`;
    chart.append(tick);
  }
  return chart;
}

// By default one row per (run, rank, rule, module): its first step, its last
// and how often it fired; 'every step' lists each occurrence instead.
function tableRows(alerts) {
  if (state.everyStep) return alerts.map((a) => ({...a, last: a.step}));
  const rows = new Map();
  for (const a of alerts) {
    const key = JSON.stringify([a.run, a.rank ?? 0, a.rule, a.module]);
    const row = rows.get(key);
    if (!row) rows.set(key, {...a, last: a.step});
    else {
      row.last = Math.max(row.last, a.step);
      row.count = Math.max(row.count ?? 1, a.count ?? 1);
    }
  }
  return [...rows.values()];
}

function alertTable(alerts) {
  if (!alerts.length) return el('div', {class: 'empty'}, 'no alerts for this selection');
  const head = el('tr', {}, ...['run', 'step', 'last step', 'rank', 'severity', 'rule', 'module',
    'message', 'hint', 'count'].map((h) => el('th', {}, h)));
  const rows = tableRows(alerts).map((a) => el('tr', {
    class: `alert-row sev-${a.severity}`, 'data-rule': a.rule, 'data-step': a.step,
    'data-module': a.module ?? '', 'data-rank': a.rank ?? 0,
  },
  el('td', {}, a.run || '.'),
  el('td', {class: 'num'}, a.step),
  el('td', {class: 'num'}, a.last),
  el('td', {class: 'num'}, a.rank ?? 0),
  el('td', {class: 'sev', style: `color:${COLORS[a.severity] || '#000'}`}, a.severity),
  el('td', {}, a.rule),
  el('td', {}, moduleLabel(a.module)),
  el('td', {}, a.message),
  el('td', {class: 'hint'}, a.hint),
  el('td', {class: 'num'}, a.count ?? 1)));
  return el('table', {class: 'alerts'}, el('thead', {}, head), el('tbody', {}, ...rows));
}

// Steps are grouped into at most MAX_COLUMNS columns. A column shows the
// largest finite norm of its steps, but any NaN, Inf or zero among them marks
// the whole cell: a single bad step is never averaged away.
function columns(norms, marks) {
  const steps = [...new Set([...norms.steps, ...marks.map((m) => m.step)])].sort((a, b) => a - b);
  const per = Math.max(1, Math.ceil(steps.length / MAX_COLUMNS));
  const groups = [];
  for (let i = 0; i < steps.length; i += per) groups.push(steps.slice(i, i + per));
  return groups;
}

function classify(value) {
  if (value === null || value === undefined) return 'missing';
  if (typeof value === 'string') return value.toLowerCase().includes('nan') ? 'nan' : 'inf';
  if (value === 0) return 'zero';
  return 'value';
}

function heatmapSection(run) {
  const norms = state.norms[run];
  const section = el('div', {class: 'heatmap-section', 'data-run': run});
  section.append(el('h2', {}, `Gradient norm by layer — ${run || '.'}`));
  if (!norms || !norms.layers.length) {
    section.append(el('div', {class: 'empty'}, 'no gradient norms in this run'));
    return section;
  }
  const marks = (state.alerts && state.alerts.marks[run]) || [];
  const order = (state.alerts && state.alerts.layers[run]) || [];
  const layers = [...norms.layers].sort((a, b) => rank(order, a) - rank(order, b));
  const index = Object.fromEntries(norms.steps.map((s, i) => [s, i]));
  const groups = columns(norms, marks);
  let lo = Infinity; let hi = -Infinity;
  for (const row of norms.values) {
    for (const v of row) {
      if (typeof v === 'number' && v > 0) {
        lo = Math.min(lo, Math.log10(v)); hi = Math.max(hi, Math.log10(v));
      }
    }
  }
  if (!isFinite(lo)) { lo = 0; hi = 1; }
  if (hi - lo < 1e-9) hi = lo + 1;
  const cell = Math.max(3, Math.min(14, Math.floor(760 / groups.length)));
  const labelWidth = Math.min(220, 10 + 7 * Math.max(...layers.map((l) => l.length)));
  const width = labelWidth + cell * groups.length + 10;
  const top = 10;  // a strip above the rows marks the columns that had alerts
  const height = top + 14 * layers.length + 30;
  const chart = svg('svg', {width, height, class: 'heatmap', role: 'img'});
  const worst = new Map();  // column -> most severe alert in it
  for (const alert of visibleAlerts().filter((a) => a.run === run)) {
    const c = groups.findIndex((g) => g[0] <= alert.step && alert.step <= g[g.length - 1]);
    const sev = SEVERITIES.indexOf(alert.severity);
    if (c >= 0 && (!worst.has(c) || sev < worst.get(c))) worst.set(c, sev);
  }
  for (const [c, sev] of worst) {
    const tick = svg('rect', {x: labelWidth + c * cell, y: 1, width: Math.max(1, cell - 1),
      height: top - 3, fill: COLORS[SEVERITIES[sev]], class: 'alert-tick'});
    const tip = svg('title');
    tip.textContent = `${SEVERITIES[sev]} alert(s) at step ${groups[c][0]}` +
      (groups[c].length > 1 ? `–${groups[c][groups[c].length - 1]}` : '');
    tick.append(tip);
    chart.append(tick);
  }
  layers.forEach((layer, r) => {
    const row = norms.values[norms.layers.indexOf(layer)];
    const layerMarks = marks.filter((m) => m.layer === layer);
    const label = svg('text', {x: 2, y: top + 14 * r + 11});
    label.textContent = layer;
    chart.append(label);
    groups.forEach((group, c) => {
      let kind = 'missing'; let best = null; const seen = {nan: 0, inf: 0, zero: 0};
      for (const step of group) {
        const v = index[step] === undefined ? null : row[index[step]];
        const k = classify(v);
        if (k in seen) seen[k] += 1;
        if (k === 'value') best = best === null ? v : Math.max(best, v);
      }
      for (const m of layerMarks) {
        if (group.includes(m.step) && m.kind in seen && !seen[m.kind]) seen[m.kind] = 1;
      }
      if (seen.nan) kind = 'nan';
      else if (seen.inf) kind = 'inf';
      else if (seen.zero) kind = 'zero';
      else if (best !== null) kind = 'value';
      const fill = kind === 'value' ? scale((Math.log10(best) - lo) / (hi - lo)) : SPECIAL[kind];
      const rect = svg('rect', {
        x: labelWidth + c * cell, y: top + 14 * r, width: Math.max(1, cell - 1), height: 13, fill,
        class: `cell cell-${kind}`, 'data-layer': layer, 'data-step': group[0],
        'data-kind': kind,
      });
      const tip = svg('title');
      const span = group.length > 1 ? `steps ${group[0]}–${group[group.length - 1]}` :
        `step ${group[0]}`;
      const what = kind === 'value' ? best.toPrecision(3) :
        `${kind}${group.length > 1 ? ` (${seen[kind]} of ${group.length} steps)` : ''}`;
      tip.textContent = `${layer}, ${span}: ${what}`;
      rect.append(tip);
      chart.append(rect);
    });
  });
  const first = svg('text', {x: labelWidth, y: height - 6});
  first.textContent = `step ${groups[0][0]}`;
  const lastGroup = groups[groups.length - 1];
  const last = svg('text', {x: Math.max(labelWidth + 60, width - 70), y: height - 6});
  last.textContent = `step ${lastGroup[lastGroup.length - 1]}`;
  chart.append(first, last);
  section.append(legend(lo, hi), chart);
  return section;
}

function rank(order, layer) {
  const i = order.indexOf(layer);
  return i < 0 ? order.length : i;
}

// A perceptual-ish ramp from dark blue (small norms) to yellow (large).
function scale(t) {
  const stops = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const x = Math.min(1, Math.max(0, t)) * (stops.length - 1);
  const i = Math.min(stops.length - 2, Math.floor(x)); const f = x - i;
  const mix = stops[i].map((v, k) => Math.round(v + f * (stops[i + 1][k] - v)));
  return `rgb(${mix.join(',')})`;
}

function legend(lo, hi) {
  const item = (color, text) => el('span', {}, el('span', {class: 'swatch',
    style: `background:${color}`}), text);
  return el('div', {class: 'legend'},
      item(scale(0), `≤ ${Math.pow(10, lo).toPrecision(2)}`),
      item(scale(1), `${Math.pow(10, hi).toPrecision(2)}`),
      item(SPECIAL.nan, 'NaN'), item(SPECIAL.inf, 'Inf'), item(SPECIAL.zero, 'exactly zero'),
      item(SPECIAL.missing, 'no gradient / not logged'));
}

// -- entry point --------------------------------------------------------------

export async function render() {
  document.head.append(el('style', {}, STYLE));
  ui.runSelect = el('select', {class: 'run-select', onchange: (e) => {
    state.run = e.target.value; load();
  }});
  const boxes = SEVERITIES.map((severity) => el('label', {},
      el('input', {type: 'checkbox', checked: '', class: `sev-filter sev-${severity}`,
        onchange: (e) => {
          if (e.target.checked) state.severities.add(severity);
          else state.severities.delete(severity);
          draw();
        }}), severity));
  ui.status = el('span', {class: 'status'});
  ui.count = el('span', {class: 'count'});
  ui.timeline = el('div', {class: 'timeline-box'});
  ui.table = el('div', {class: 'table-box'});
  ui.heatmaps = el('div', {class: 'heatmaps'});
  document.body.append(
      el('div', {class: 'controls'}, el('label', {}, 'run ', ui.runSelect), ...boxes,
          el('label', {}, el('input', {type: 'checkbox', class: 'every-step', onchange: (e) => {
            state.everyStep = e.target.checked; draw();
          }}), 'every step'),
          el('button', {onclick: () => load()}, 'Reload'), ui.count, ui.status),
      el('h2', {}, 'Alerts over steps'), ui.timeline,
      el('h2', {}, 'Alerts'), ui.table,
      ui.heatmaps);
  await load();
  setInterval(() => { if (!document.hidden) load(); }, RELOAD_MS);
  document.addEventListener('visibilitychange', () => { if (!document.hidden) load(); });
}
