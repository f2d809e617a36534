# source scripts/uv-from-pip.sh PYTHON: uv reads UV_* settings, not pip's. Carry over the index, the extra indexes,
# find-links and the CA bundle from pip's environment variables or configuration files (PYTHON's pip reads them),
# where no UV_* setting says otherwise, and resolve as pip does: the newest version any of them holds. (uv's own
# default takes each package from the first index that has it, at whatever version that index holds: a venv of
# older releases than pip would install.) PyTorch's indexes are left out: they are for torch alone
# (scripts/install-torch.sh). Sourced by scripts/quickstart.sh; tests/test_readme.py runs it against two indexes.
_pip_python=$1
pip_setting() {  # PIP_<NAME> from the environment, else pip's configuration (global.<name>)
    local env="PIP_$(echo "$1" | tr 'a-z-' 'A-Z_')"
    if [ -n "${!env:-}" ]; then echo "${!env}"; return 0; fi
    "$_pip_python" -m pip config list 2>/dev/null | sed -n "s/^\(global\|install\)\.$1='\(.*\)'\$/\2/p" | tail -n 1
}
carry() {  # carry UV_NAME pip-name [separator]
    local value
    [ -n "${!1:-}" ] && return 0
    value=$(pip_setting "$2" | tr ' ' '\n' | { grep -v '^https\?://download\.pytorch\.org/' || true; } | xargs)
    [ -n "$value" ] && export "$1=$(echo $value | tr ' ' "${3:- }")"
    return 0
}
carry UV_INDEX_URL index-url
carry UV_EXTRA_INDEX_URL extra-index-url
carry UV_FIND_LINKS find-links ,
carry SSL_CERT_FILE cert
export UV_INDEX_STRATEGY=${UV_INDEX_STRATEGY:-unsafe-best-match}

